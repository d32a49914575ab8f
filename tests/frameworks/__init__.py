"""normhooks inside the training frameworks, against the techniques written out by hand."""
