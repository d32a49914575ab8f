"""Spectral normalization and σReparam: the formula, torch's spectral_norm and SVD as
references, when the power iteration advances, checkpoints and takeover both ways with torch,
baking, σReparam's gamma, and the refusals. The lifecycle is the contract suite's."""

from __future__ import annotations

import copy
import importlib
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import spectral_norm as torch_spectral_norm

from helpers import LAYERS, input_for
from normhooks import SpectralNorm, apply_spectral_norm, remove_spectral_norm, spectral_norm

_torch_compat = importlib.import_module("normhooks._torch_compat")

F64 = torch.float64


def layer(name: str) -> nn.Module:
    torch.manual_seed(0)
    return LAYERS[name]().to(F64)


def sn_of(module: nn.Module, name: str = "weight") -> SpectralNorm:
    found = module.parametrizations[name][0]
    assert isinstance(found, SpectralNorm)
    return found


def raw(module: nn.Module, name: str = "weight") -> torch.Tensor:
    return module.parametrizations[name].original


def as_matrix(weight: torch.Tensor, dim: int) -> torch.Tensor:
    """The weight with axis ``dim`` as rows, written out with permute and reshape."""
    order = [dim, *(d for d in range(weight.ndim) if d != dim)]
    return weight.permute(order).reshape(weight.shape[dim], -1)


def unit(vector: torch.Tensor) -> torch.Tensor:
    return vector / vector.norm()


def vectors(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    chain = module.parametrizations.weight[0]
    return chain._u.clone(), chain._v.clone()


def torch_dim(module: nn.Module) -> int:
    return 1 if isinstance(module, nn.modules.conv._ConvTransposeNd) else 0


# --- the formula ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", LAYERS)
def test_eval_weight_is_the_weight_over_u_m_v(name: str) -> None:
    module = spectral_norm(layer(name)).eval()
    dim = torch_dim(module)
    assert sn_of(module).dim == dim
    u, v = vectors(module)
    w = raw(module).detach()
    expected = w / (u @ as_matrix(w, dim) @ v)
    torch.testing.assert_close(module.weight, expected, rtol=1e-12, atol=0)


@settings(max_examples=30, deadline=None)
@given(shape=st.lists(st.integers(1, 4), min_size=2, max_size=4), data=st.data())
def test_the_formula_holds_for_any_shape_and_dim(shape: list[int], data: st.DataObject) -> None:
    dim = data.draw(st.integers(-len(shape), len(shape) - 1), label="dim")
    weight = torch.randn(shape, dtype=F64) + 0.1  # never all zeros
    sn = SpectralNorm(weight, dim=dim).eval()
    expected = weight / (sn._u @ as_matrix(weight, dim % len(shape)) @ sn._v)
    torch.testing.assert_close(sn(weight), expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("iterations", [1, 3], ids=["one-step", "three-steps"])
def test_a_training_forward_takes_the_papers_power_iteration_steps(iterations: int) -> None:
    module = spectral_norm(layer("conv2d"), n_power_iterations=iterations)
    w = raw(module).detach()
    m = as_matrix(w, 0)
    u, v = vectors(module)
    for _ in range(iterations):
        u = unit(m @ v)
        v = unit(m.T @ u)
    weight = module.weight
    torch.testing.assert_close(vectors(module), (u, v), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(weight, w / (u @ m @ v), rtol=1e-12, atol=0)


@pytest.mark.parametrize("name", ["linear", "conv2d", "deconv2d-grouped", "bilinear"])
def test_sigma_converges_to_the_largest_singular_value(name: str) -> None:
    module = spectral_norm(layer(name))
    for _ in range(300):
        module.weight  # noqa: B018 (each training access advances u and v)
    module.eval()
    dim = torch_dim(module)
    largest = torch.linalg.svdvals(as_matrix(raw(module).detach(), dim))[0]
    u, v = vectors(module)
    torch.testing.assert_close(u @ as_matrix(raw(module).detach(), dim) @ v, largest)
    normalized = torch.linalg.svdvals(as_matrix(module.weight.detach(), dim))[0]
    torch.testing.assert_close(normalized, torch.tensor(1.0, dtype=F64))


@pytest.mark.parametrize("scale", [False, True], ids=["sn", "sigma-reparam"])
def test_gradcheck(scale: bool) -> None:
    weight = torch.randn(4, 3, 2, dtype=F64)
    sn = SpectralNorm(weight, scale=scale).eval()
    inputs: tuple[torch.Tensor, ...] = (weight.requires_grad_(),)
    if scale:
        assert sn.gamma is not None
        gamma = sn.gamma

        def run(w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
            return torch.func.functional_call(sn, {"gamma": g}, (w,))

        assert torch.autograd.gradcheck(run, (weight, gamma.detach().requires_grad_()))
    else:
        assert torch.autograd.gradcheck(sn, inputs)
        assert torch.autograd.gradgradcheck(sn, inputs)


def test_the_gradient_treats_u_and_v_as_constants() -> None:
    """d(W / (u.Mv))/dW with u, v fixed: G / sigma - (sum(G * W) / sigma^2) u v^T."""
    module = spectral_norm(layer("linear")).eval()
    u, v = vectors(module)
    w = raw(module).detach()
    sigma = u @ w @ v
    grad_out = torch.randn_like(w)
    module.weight.backward(grad_out)
    expected = grad_out / sigma - (grad_out * w).sum() / sigma**2 * torch.outer(u, v)
    torch.testing.assert_close(raw(module).grad, expected)


# --- torch's spectral_norm as the reference -------------------------------------------------


def twins(name: str, **settings: int) -> tuple[nn.Module, nn.Module]:
    """torch's spectral norm and ours on copies of one layer, ours with torch's vectors."""
    theirs = layer(name)
    ours = copy.deepcopy(theirs)
    torch_spectral_norm(theirs, **settings)
    spectral_norm(ours, **settings)
    with torch.no_grad():
        sn_of(ours)._u.copy_(theirs.parametrizations.weight[0]._u)
        sn_of(ours)._v.copy_(theirs.parametrizations.weight[0]._v)
    return theirs, ours


@pytest.mark.parametrize("iterations", [1, 2], ids=["n1", "n2"])
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("name", LAYERS)
def test_matches_torch_spectral_norm_given_the_same_vectors(
    name: str, mode: str, iterations: int
) -> None:
    theirs, ours = twins(name, n_power_iterations=iterations)
    theirs.train(mode == "train")
    ours.train(mode == "train")
    for _ in range(3):
        x = input_for(theirs, F64)
        expected, actual = theirs(*x), ours(*x)
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)
        grad = torch.randn_like(expected)
        expected.backward(grad)
        actual.backward(grad)
        torch.testing.assert_close(raw(ours).grad, raw(theirs).grad, rtol=0, atol=0)
        torch.testing.assert_close(vectors(ours), vectors(theirs), rtol=0, atol=0)


def test_two_forwards_of_one_step_advance_twice_and_backpropagate_as_torchs() -> None:
    """A GAN discriminator's step: D(real) and D(fake), then one backward through both."""
    theirs, ours = twins("conv2d")
    real, fake = torch.randn(2, 3, 5, 5, dtype=F64), torch.randn(2, 3, 5, 5, dtype=F64)
    (theirs(real).mean() - theirs(fake).mean()).backward()
    (ours(real).mean() - ours(fake).mean()).backward()
    torch.testing.assert_close(raw(ours).grad, raw(theirs).grad, rtol=0, atol=0)
    torch.testing.assert_close(vectors(ours), vectors(theirs), rtol=0, atol=0)


def test_torch_checkpoint_loads_into_ours() -> None:
    theirs = torch_spectral_norm(layer("deconv2d"))
    theirs(*input_for(theirs, F64))  # advances its vectors
    ours = spectral_norm(layer("deconv2d"))
    ours.load_state_dict(theirs.state_dict())
    assert list(ours.state_dict()) == list(theirs.state_dict())
    x = input_for(theirs, F64)
    torch.testing.assert_close(ours(*x), theirs(*x), rtol=0, atol=0)


def test_our_checkpoint_loads_into_torchs() -> None:
    ours = spectral_norm(layer("conv1d"))
    ours(*input_for(ours, F64))
    theirs = torch_spectral_norm(layer("conv1d"))
    theirs.load_state_dict(ours.state_dict())
    x = input_for(ours, F64)
    torch.testing.assert_close(theirs(*x), ours(*x), rtol=0, atol=0)


# --- when the power iteration advances ------------------------------------------------------


def test_an_eval_forward_never_advances() -> None:
    module = spectral_norm(layer("linear")).eval()
    before = vectors(module)
    for _ in range(3):
        module(*input_for(module, F64))
    torch.testing.assert_close(vectors(module), before, rtol=0, atol=0)


def test_parametrize_cached_advances_once_per_scope() -> None:
    cached = spectral_norm(layer("linear"))
    once = copy.deepcopy(cached)
    with parametrize.cached():
        for _ in range(3):
            cached(*input_for(cached, F64))
    once(*input_for(once, F64))
    torch.testing.assert_close(vectors(cached), vectors(once), rtol=0, atol=0)


def test_torch_func_vmap_in_training_mode_leaves_the_vectors() -> None:
    module = spectral_norm(layer("linear"))
    before = vectors(module)
    x = torch.randn(4, 5, dtype=F64)
    params = dict(module.named_parameters())
    out = torch.func.vmap(lambda xi: torch.func.functional_call(module, params, (xi,)))(x)
    torch.testing.assert_close(vectors(module), before, rtol=0, atol=0)
    torch.testing.assert_close(out, module.eval()(x))


def test_compiled_training_advances_the_vectors_as_eager() -> None:
    torch._dynamo.reset()
    eager = spectral_norm(layer("conv2d"))
    compiled_module = copy.deepcopy(eager)
    compiled = torch.compile(compiled_module, backend="aot_eager")
    x = input_for(eager, F64)
    for _ in range(3):
        torch.testing.assert_close(compiled(*x), eager(*x))
    torch.testing.assert_close(vectors(compiled_module), vectors(eager))


def test_conversion_draws_no_random_numbers_and_starts_alike() -> None:
    first, second = layer("conv2d"), layer("conv2d")
    torch.manual_seed(3)
    expected = torch.rand(())
    torch.manual_seed(3)
    spectral_norm(first)
    torch.testing.assert_close(torch.rand(()), expected, rtol=0, atol=0)
    spectral_norm(second)
    torch.testing.assert_close(vectors(first), vectors(second), rtol=0, atol=0)


def test_conversion_leaves_the_vectors_as_its_warm_up_made_them_in_either_mode() -> None:
    """Registering computes the weight once as a check: in eval mode, whatever the layer's."""
    trained, evaluated = layer("linear").train(), layer("linear").eval()
    spectral_norm(trained)
    spectral_norm(evaluated)
    assert sn_of(trained).training
    assert not sn_of(evaluated).training
    torch.testing.assert_close(vectors(trained), vectors(evaluated), rtol=0, atol=0)


def _ddp_rank(rank: int, world: int, init: str, out: str) -> None:
    """One rank: rank 1's vectors are made to differ before each forward of a DDP model."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    finished = False
    try:
        torch.manual_seed(0)
        model = apply_spectral_norm(nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)))
        ddp = nn.parallel.DistributedDataParallel(model)
        torch.manual_seed(1 + rank)
        x = torch.randn(5, 4)
        for _ in range(2):
            if rank == 1:
                with torch.no_grad():
                    for buffer in model.buffers():
                        buffer.copy_(torch.randn_like(buffer))
            ddp(x).square().sum().backward()
        state = {name: buffer.clone() for name, buffer in model.named_buffers()}
        torch.save(state, Path(out) / f"rank{rank}.pt")
        dist.barrier()
        finished = True
    finally:
        dist.destroy_process_group()
    if finished:
        # As tests/distributed_worker.py does: gloo's worker threads can outlive the process
        # group and abort the interpreter's shutdown (SIGABRT, "terminate called without an
        # active exception"); a rank that has saved its results has nothing left to clean up.
        os._exit(0)


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")
def test_ddp_ranks_advance_rank_0s_vectors_alike(tmp_path: Path) -> None:
    """DDP broadcasts buffers from rank 0 at every forward: the ranks' u and v agree."""
    mp.spawn(_ddp_rank, args=(2, f"file://{tmp_path / 'group'}", str(tmp_path)), nprocs=2)
    first, second = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert list(first) == list(second)
    assert len(first) == 4
    for name, value in first.items():
        torch.testing.assert_close(second[name], value, rtol=0, atol=0)


# --- σReparam -------------------------------------------------------------------------------


def test_gamma_starts_at_sigma_so_the_output_is_unchanged() -> None:
    plain = layer("conv2d").eval()
    x = input_for(plain, F64)
    expected = plain(*x)
    module = spectral_norm(copy.deepcopy(plain), scale=True)
    u, v = vectors(module)
    sigma = u @ as_matrix(raw(module).detach(), 0) @ v
    gamma = sn_of(module).gamma
    assert isinstance(gamma, nn.Parameter)
    assert gamma.shape == ()
    torch.testing.assert_close(gamma.detach(), sigma, rtol=0, atol=0)
    torch.testing.assert_close(module(*x), expected, rtol=0, atol=0)


def test_gamma_trains_and_scales_the_normalized_weight() -> None:
    module = spectral_norm(layer("linear"), scale=True)
    sn = sn_of(module)
    assert sn.gamma is not None
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    start = sn.gamma.detach().clone()
    x = input_for(module, F64)
    for _ in range(3):
        optimizer.zero_grad()
        module(*x).square().sum().backward()
        optimizer.step()
    assert not torch.equal(sn.gamma.detach(), start)
    module.eval()
    u, v = vectors(module)
    w = raw(module).detach()
    expected = sn.gamma.detach() / (u @ w @ v) * w
    torch.testing.assert_close(module.weight.detach(), expected)


def test_gammas_gradient_is_the_normalized_weights_dot_the_output_gradient() -> None:
    module = spectral_norm(layer("linear"), scale=True).eval()
    u, v = vectors(module)
    w = raw(module).detach()
    grad_out = torch.randn_like(w)
    module.weight.backward(grad_out)
    gamma = sn_of(module).gamma
    assert gamma is not None
    torch.testing.assert_close(gamma.grad, (grad_out * w).sum() / (u @ w @ v))


def test_an_optimizer_without_gamma_is_refused_at_its_second_step() -> None:
    module = layer("linear")
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    spectral_norm(module, scale=True)
    x = input_for(module, F64)
    module(*x).sum().backward()
    optimizer.step()  # another optimizer, built after, may still train gamma
    with pytest.raises(ValueError, match=r"SigmaReparam was applied .*Linear\.parametrizations"):
        optimizer.step()


def test_a_packed_attention_projection_trains_its_gamma() -> None:
    mha = spectral_norm(nn.MultiheadAttention(8, 2, batch_first=True), "in_proj_weight", scale=True)
    x = torch.randn(2, 3, 8)
    mha(x, x, x)[0].square().sum().backward()
    gamma = sn_of(mha, "in_proj_weight").gamma
    assert gamma is not None
    assert gamma.grad is not None
    assert gamma.grad.abs() > 0


# --- taking over torch's spectral norm ------------------------------------------------------


def torch_model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.ReLU(), nn.ConvTranspose2d(4, 2, 2), nn.Flatten(), nn.LazyLinear(3)
    ).to(F64)
    model(torch.randn(1, 3, 6, 6, dtype=F64))
    torch_spectral_norm(model[0], n_power_iterations=2, eps=1e-8)
    torch_spectral_norm(model[2])
    return model


def test_apply_takes_torchs_over_in_place() -> None:
    model = torch_model()
    reference = copy.deepcopy(model)
    keys = list(model.state_dict())
    weight, u = raw(model[0]), model[0].parametrizations.weight[0]._u
    apply_spectral_norm(model)
    assert [k for k in model.state_dict() if not k.startswith("4.")] == keys[:-2]
    assert raw(model[0]) is weight
    assert sn_of(model[0])._u is u
    first = sn_of(model[0])
    assert (first.dim, first.n_power_iterations, first.eps) == (0, 2, 1e-8)
    assert sn_of(model[2]).dim == 1
    x = torch.randn(2, 3, 6, 6, dtype=F64)
    for _ in range(2):  # training forwards advance both alike
        torch.testing.assert_close(model[:4](x), reference[:4](x), rtol=0, atol=0)
    torch.testing.assert_close(vectors(model[2]), vectors(reference[2]), rtol=0, atol=0)


def test_a_taken_over_layer_keeps_its_output_with_sigma_reparam() -> None:
    model = torch_model().eval()
    x = torch.randn(2, 3, 6, 6, dtype=F64)
    expected = model[:3](x)
    apply_spectral_norm(model, scale=True)
    gamma = sn_of(model[0]).gamma
    assert gamma is not None
    assert gamma.item() == 1.0
    torch.testing.assert_close(model[:3](x), expected, rtol=0, atol=0)


def test_one_parameter_taken_over_needs_torchs_dim() -> None:
    module = torch_spectral_norm(layer("deconv2d"))
    with pytest.raises(ValueError, match=r"along dim=1; .* pass dim=1 \(or None\), got dim=0"):
        spectral_norm(module, dim=0)
    assert not isinstance(module.parametrizations.weight[0], SpectralNorm)
    spectral_norm(module, n_power_iterations=3)
    assert (sn_of(module).dim, sn_of(module).n_power_iterations) == (1, 3)


def test_a_refused_layer_leaves_the_taken_over_ones_torchs() -> None:
    model = torch_model()
    with torch.no_grad():
        model[4].weight.zero_()
    with pytest.raises(ValueError, match=r"Linear\.weight is all zeros"):
        apply_spectral_norm(model)
    assert isinstance(model[0].parametrizations.weight[0], _torch_compat.TorchSpectralNorm)
    assert not parametrize.is_parametrized(model[4])


# --- removing -------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [False, True], ids=["sn", "sigma-reparam"])
def test_baking_in_training_mode_keeps_what_an_eval_forward_computes(scale: bool) -> None:
    module = spectral_norm(layer("conv2d"), scale=scale)
    module(*input_for(module, F64))
    weight = raw(module)
    with torch.no_grad():
        expected = copy.deepcopy(module).eval().weight
    remove_spectral_norm(module)
    assert module.weight is weight
    torch.testing.assert_close(module.weight.detach(), expected, rtol=0, atol=0)


def test_removing_without_baking_restores_the_raw_weight() -> None:
    module = spectral_norm(layer("linear"))
    weight = raw(module)
    before = weight.detach().clone()
    remove_spectral_norm(module, "weight", bake=False)
    assert module.weight is weight
    torch.testing.assert_close(module.weight.detach(), before, rtol=0, atol=0)


def test_default_layers_are_the_linear_maps() -> None:
    model = nn.Sequential(
        nn.Embedding(5, 4), nn.Linear(4, 4), nn.Bilinear(4, 4, 2), nn.Conv1d(2, 2, 1)
    )
    apply_spectral_norm(model)
    converted = [parametrize.is_parametrized(m) for m in model]
    assert converted == [False, True, True, True]
    apply_spectral_norm(model, layer_types=nn.Embedding)
    assert parametrize.is_parametrized(model[0])


# --- refusals -------------------------------------------------------------------------------


ARGUMENT_ERRORS = [
    (dict(n_power_iterations=0), ValueError, r"n_power_iterations must be positive, got n_power"),
    (dict(n_power_iterations=1.5), TypeError, r"n_power_iterations must be an int, got"),
    (dict(eps=0.0), ValueError, r"eps must be positive, got eps=0\.0"),
    (dict(eps="small"), TypeError, r"eps must be a real number, got eps='small'"),
    (dict(dim=2), ValueError, r"dim must be in \[-2, 1\] for Linear\.weight .* got dim=2"),
    (dict(dim=0.0), TypeError, r"dim must be an int, got dim=0\.0"),
    (dict(scale=1), TypeError, r"scale must be a bool, got scale=1"),
]


@pytest.mark.parametrize(
    ("settings", "error", "match"),
    ARGUMENT_ERRORS,
    ids=[
        "iterations-zero",
        "iterations-float",
        "eps-zero",
        "eps-str",
        "dim-range",
        "dim-float",
        "scale-int",
    ],
)
def test_bad_settings_are_refused_and_leave_the_layer(
    settings: dict[str, object], error: type[Exception], match: str
) -> None:
    module = nn.Linear(3, 2)
    with pytest.raises(error, match=match):
        spectral_norm(module, **settings)  # type: ignore[arg-type]
    assert not parametrize.is_parametrized(module)


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: nn.Linear(3, 2), None, r"Linear\.weight is all zeros: its largest singular"),
        (lambda: nn.LayerNorm(3), ValueError, r"LayerNorm\.weight has 1 dimension; spectral"),
    ],
    ids=["zero-weight", "vector"],
)
def test_weights_without_a_spectral_norm_are_refused(
    make: Callable[[], nn.Module], error: type[Exception] | None, match: str
) -> None:
    module = make()
    if error is None:
        with torch.no_grad():
            module.weight.zero_()
    with pytest.raises(ValueError, match=match):
        spectral_norm(module)
    assert not parametrize.is_parametrized(module)


def test_converting_twice_is_refused() -> None:
    module = spectral_norm(nn.Linear(3, 2))
    with pytest.raises(ValueError, match=r"Linear\.weight is already spectrally normalized"):
        spectral_norm(module)


def test_removing_what_is_not_there_is_refused() -> None:
    with pytest.raises(ValueError, match=r"Sequential has no spectral normalization to remove"):
        remove_spectral_norm(nn.Sequential(nn.Linear(3, 2)))
    with pytest.raises(TypeError, match=r"bake must be a bool, got bake=None"):
        remove_spectral_norm(spectral_norm(nn.Linear(3, 2)), bake=None)  # type: ignore[arg-type]


def test_the_parametrization_refuses_a_weight_of_zeros() -> None:
    with pytest.raises(ValueError, match=r"weight is all zeros: its largest singular value"):
        SpectralNorm(torch.zeros(2, 3))


@pytest.mark.parametrize(
    ("start", "match"),
    [
        ((torch.ones(3), torch.ones(4)), r"u must have shape \[2\] .* 2 x 4, got u of shape \[3\]"),
        ((torch.ones(2), torch.ones(2, 2)), r"v must have shape \[4\] .* got v of shape \[2, 2\]"),
    ],
    ids=["u", "v"],
)
def test_start_vectors_of_the_wrong_shape_are_refused(
    start: tuple[torch.Tensor, torch.Tensor], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        SpectralNorm(torch.randn(2, 4), start=start)
