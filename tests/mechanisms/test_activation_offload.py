"""hookbench.mechanisms.activation_offload: saved activations in host memory until backward, optionally
compressed. Lossless offload is bit for bit training without it; compression stays within the
bound derived for each mode; every trap a real implementation handles is pinned, and what torch
itself does under saved-tensor hooks (no version check, checkpoint's hooks innermost, compile)
is pinned beside it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.autograd.graph import disable_saved_tensors_hooks, saved_tensors_hooks
from torch.utils.checkpoint import checkpoint

from hookbench.core.workload import of
from hookbench.measure.faults import inject
from hookbench.measure.memory import measure
from hookbench.measure.parity import compare, trajectory
from hookbench.mechanisms.activation_offload import ActivationOffload, copying_to_host
from hookbench.models.zoo import TinySpec
from hookbench.models.zoo import workload as zoo_workload


def _mlp(width: int = 64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))


def _grads(model: nn.Module, x: torch.Tensor, offload: ActivationOffload | None = None):
    model.zero_grad(set_to_none=True)
    with offload if offload is not None else saved_tensors_hooks(lambda t: t, lambda t: t):
        loss = model(x).square().sum()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


# -- lossless: bit for bit ----------------------------------------------------------------------

@settings(deadline=None, max_examples=15)
@given(depth=st.integers(1, 3), width=st.sampled_from([32, 64]),
       min_bytes=st.sampled_from([0, 256, 1024, 1 << 30]),
       strategy=st.sampled_from(["forloop", "foreach", "in_backward", "in_backward_grouped",
                                 "in_backward_bucketed"]))
def test_lossless_offload_trains_bit_for_bit_like_no_offload(depth, width, min_bytes, strategy):
    # batch 16: activations of 2-4 KB, above the workload's 1 KB threshold
    spec = of(TinySpec(depth=depth, width=width, batch_size=16))
    adam = (torch.optim.Adam, {"lr": 1e-2})
    plain = trajectory(spec, *adam, strategy, steps=3)
    offloaded = trajectory(spec.replace(offload="lossless"), *adam, strategy, steps=3)
    assert compare(offloaded, plain).bit_exact
    with inject("compression_on_exact_tensor"):  # something was offloaded: compressing it shows
        lossy = trajectory(spec.replace(offload="lossless"), *adam, strategy, steps=3)
    assert not compare(lossy, plain).bit_exact
    model, x = _mlp(width), torch.randn(8, width)
    assert all(torch.equal(a, b) for a, b in zip(
        _grads(model, x, ActivationOffload(model, min_bytes=min_bytes)), _grads(model, x)))


def test_offload_moves_what_it_says_and_keeps_the_parameters():
    model, x = _mlp(), torch.randn(32, 64, requires_grad=True)
    offload = ActivationOffload(model)
    seen = []
    with saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        model(x).square().sum()
    _grads(model, x, offload)
    # Linear saves its input and (a view of) its weight; GELU its input; square its input.
    storages = {id(p.untyped_storage()) for p in model.parameters()}
    params = [t for t in seen if id(t.untyped_storage()) in storages]
    assert len(params) == 2
    assert offload.kept == len(params) + 1  # the weights, and x: a leaf that requires grad
    assert offload.packed == offload.unpacked == len(seen) - offload.kept == 3
    assert offload.host_bytes == 0  # every host copy freed with the graph


def test_a_view_of_a_parameter_stays_on_the_device():
    lin = nn.Linear(4, 4)
    offload = ActivationOffload(lin, min_bytes=0)
    with offload:
        x = torch.randn(2, 4, requires_grad=True) * 1  # not a leaf: offloaded
        loss = (x @ lin.weight.t()).sum()  # mm saves x and the view weight.t()
    loss.backward()
    assert (offload.packed, offload.kept) == (1, 1)  # the input goes, the weight's view stays


def test_a_tensor_saved_twice_is_copied_once_and_unpacked_each_time():
    t = torch.randn(1000, requires_grad=True)
    offload = ActivationOffload()
    with offload:
        y = t * 2
        loss = (y * y).sum()  # mul saves y twice
    loss.backward()
    assert (offload.packed, offload.unpacked) == (1, 2)
    assert torch.equal(t.grad, 8 * t.detach())


def test_a_graph_kept_for_a_second_backward_brings_each_tensor_back_twice():
    t = torch.randn(1000, requires_grad=True)
    offload = ActivationOffload()
    with offload:
        loss = (t * 2).sin().sum()
    loss.backward(retain_graph=True)
    first = t.grad.clone()
    loss.backward()
    assert offload.unpacked == 2 and torch.equal(t.grad, 2 * first)


def test_an_in_place_change_after_save_raises_in_torchs_words():
    t = torch.randn(1000, requires_grad=True)
    for kept in (False, True):  # offloaded, and kept (below min_bytes) on the device
        with ActivationOffload(min_bytes=1 << 30 if kept else 0):
            y = t * 2
            w = y.sin()
            y.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation: .* is at "
                                               "version 1; expected version 0 instead"):
            w.sum().backward()


def test_torch_checks_no_version_under_saved_tensor_hooks():
    """Pinned: why the mechanism checks versions itself. Identity hooks (and save_on_cpu) let an
    in-place change of a saved tensor into backward silently (torch 2.14.1)."""
    t = torch.randn(100, requires_grad=True)
    with saved_tensors_hooks(lambda x: x, lambda x: x):
        y = t * 2
        w = y.sin()
        y.add_(1)
    w.sum().backward()  # no error
    assert not torch.allclose(t.grad, 2 * torch.cos(2 * t.detach()))  # and the wrong gradient


def test_nested_in_non_reentrant_checkpointing_the_checkpoints_hooks_win():
    model, x = _mlp(), torch.randn(32, 64, requires_grad=True)
    offload = ActivationOffload(model)
    with offload:
        loss = checkpoint(model, x, use_reentrant=False).square().sum()
    loss.backward()
    # square saves the checkpoint's output (offloaded); inside, nothing is saved (recomputed)
    assert offload.packed == 1
    plain = _mlp()
    checkpoint(plain, x, use_reentrant=False).square().sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), plain.parameters()))


def test_under_reentrant_checkpointing_it_holds_and_offloads_nothing_inside():
    model, x = _mlp(), torch.randn(32, 64, requires_grad=True)
    offload = ActivationOffload(model)
    with offload:
        loss = checkpoint(model, x, use_reentrant=True).square().sum()
    loss.backward()  # the block runs without grad, then again in backward, outside the context
    assert offload.packed == 1
    plain = _mlp()
    plain(x).square().sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), plain.parameters()))


def test_disable_saved_tensors_hooks_refuses_it_in_its_own_words():
    with disable_saved_tensors_hooks("this region must keep its activations"):
        with pytest.raises(RuntimeError, match="this region must keep its activations"):
            with ActivationOffload():
                pass


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_under_torch_compile_it_offloads_and_holds(backend):
    torch._dynamo.reset()
    model, x = _mlp(), torch.randn(32, 64)
    plain = _mlp()
    plain(x).square().sum().backward()
    offload = ActivationOffload(model)
    compiled = torch.compile(model, backend=backend)
    try:
        with offload:
            loss = compiled(x).square().sum()
        loss.backward()
    finally:
        torch._dynamo.reset()
    assert offload.packed >= 3 and offload.unpacked == offload.packed  # the hooks ran
    pairs = list(zip(model.parameters(), plain.parameters()))
    if backend == "eager":  # the same kernels: bit for bit
        assert all(torch.equal(p.grad, q.grad) for p, q in pairs)
    else:  # inductor's own kernels: the foreach tolerance (hookbench.measure.parity)
        assert all(torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6) for p, q in pairs)


def test_while_torch_compile_traces_it_keeps_every_tensor():
    # torch 2.4 runs saved-tensor hooks while torch.compile traces, on its fake tensors
    # (pytorch#113263): a compressed copy made there is traced into the graph and applied again
    # to the real tensors (seen on 2.4.1, inductor, int8: gradients 0.064 off those of eager
    # offload, 2.9e-6 with this). Later releases do not call the hooks there, so the tracing
    # context is entered by hand: inside it nothing is offloaded or compressed.
    from torch._guards import TracingContext, tracing

    t = torch.randn(1000, requires_grad=True)
    offload = ActivationOffload(compress="int8")
    with tracing(TracingContext(None)), offload:
        y = (t * 2).sin()
    y.sum().backward()
    assert (offload.packed, offload.kept) == (0, 1)
    assert torch.equal(t.grad, 2 * torch.cos(2 * t.detach()))


@pytest.mark.parametrize("bad, error", [
    ({"compress": "fp8"}, ValueError), ({"min_bytes": -1}, ValueError),
    ({"min_bytes": True}, ValueError), ({"model": "model"}, TypeError),
])
def test_bad_arguments_are_refused(bad, error):
    args = {"model": None, **bad}
    with pytest.raises(error):
        ActivationOffload(args.pop("model"), **args)


# -- compressed: within the derived bound --------------------------------------------------------

# Drawn from a generator of their own, at import: the global RNG's state at collection time
# depends on what was collected before (a run of 5f235af drew a "huge" tensor that the int8
# bound, then missing float32's rounding, failed).
_G = torch.Generator().manual_seed(0)
ADVERSARIAL = {
    "large mean, tiny spread": 1e4 + 1e-3 * torch.randn(4096, generator=_G),
    "huge": 3e38 * torch.rand(4096, generator=_G),
    "tiny": 1e-30 * torch.randn(4096, generator=_G),
    "zeros": torch.zeros(4096),
    "one outlier": torch.cat([torch.randn(4095, generator=_G), torch.tensor([1e6])]),
}


@pytest.mark.parametrize("data", ADVERSARIAL.values(), ids=ADVERSARIAL.keys())
def test_compressed_values_stay_within_the_bound_of_each_mode(data):
    for mode in ("bf16", "int8"):
        offload = ActivationOffload(compress=mode, min_bytes=0)
        back = offload._unpack(offload._pack(data))
        err = (back.double() - data.double()).abs()
        if mode == "bf16":  # 8 significant bits, round to nearest: half an ulp, 2**-8 relative
            assert bool((err <= 2.0**-8 * data.double().abs()).all())
        else:  # per-tensor scale s = max|x| / 127: half a step, s / 2, plus float32 rounding
            # of s, of x / s (which can round q to the other side: 127 * 2**-24 of a step) and
            # of q * s, at most 509 * 2**-24 of s / 2 together; 6.8e-6 measured over 900
            # tensors of 3 kinds, where the old bound (1 + 1e-6) failed 4
            s = data.double().abs().max() / 127
            assert bool((err <= s / 2 * (1 + 2**-15) + 1e-45).all())


def test_compression_leaves_non_float32_tensors_exact():
    for t in (torch.arange(4096), torch.randn(4096, dtype=torch.float64)):
        offload = ActivationOffload(compress="int8", min_bytes=0)
        assert torch.equal(offload._unpack(offload._pack(t)), t)


@pytest.mark.parametrize("mode, u", [("bf16", 2.0**-8), ("int8", None)])
def test_a_linear_layers_weight_gradient_stays_within_the_bound_its_input_error_allows(mode, u):
    """dW = g^T x: an input off by e elementwise moves dW by at most |g|^T e. bf16: e = u|x|;
    int8: e = max|x| / 254. Plus float32 rounding of the product (1e-5 of |g|^T |x|)."""
    torch.manual_seed(0)
    lin, x = nn.Linear(64, 32), 1e3 + torch.randn(16, 64)  # a large mean: the hard case
    g = torch.randn(16, 32)
    exact = _weight_grad(lin, x, g, None)
    approx = _weight_grad(lin, x, g, ActivationOffload(lin, compress=mode))
    e = u * x.abs() if u is not None else torch.full_like(x, float(x.abs().max()) / 254)
    bound = g.abs().t() @ e + 1e-5 * (g.abs().t() @ x.abs())
    assert bool(((approx - exact).abs() <= bound).all())
    assert not torch.equal(approx, exact)  # it is lossy


def _weight_grad(lin, x, g, offload):
    lin.zero_grad()
    with offload if offload is not None else saved_tensors_hooks(lambda t: t, lambda t: t):
        out = lin(x)
    out.backward(g)
    return lin.weight.grad.clone()


# -- memory ---------------------------------------------------------------------------------------

def test_offloaded_activations_count_as_host_memory_not_device_memory():
    assert not copying_to_host()
    spec = zoo_workload("transformer")
    plain, lossless, bf16 = (measure(spec.replace(offload=o), "in_backward")
                             for o in (None, "lossless", "bf16"))
    assert plain.host_peak == 0 and lossless.host_peak > 0
    assert lossless.peak < plain.peak
    # bf16 keeps 2 of every 4 bytes of the float32 activations it copies: half, to within the
    # non-float tensors it leaves exact (none in this model)
    assert abs(bf16.host_peak / lossless.host_peak - 0.5) < 0.01
    assert bf16.peak <= lossless.peak


# slow: every saving row of the report measured twice, about 8 s; the default tier keeps the
# offload rows' own memory checks (count_as_host_memory) and their fault
@pytest.mark.slow
def test_the_reports_offload_rows_hold_their_saving_and_fail_when_it_is_lost():
    import dataclasses

    from hookbench import report

    spec = zoo_workload("transformer")

    def rows():
        return [dataclasses.replace(measure(spec.replace(**changes), s), strategy=label)
                for label, s, changes, *_ in (("foreach", "foreach", {}),
                                              ("in_backward", "in_backward", {}),
                                              *report.SAVING_ROWS)]

    assert report.memory_section(rows()).ok
    with inject("offload_keeps_device_copy"):
        section = report.memory_section(rows())
    assert "in_backward + offload" in [cells[0] for cells, ok in section.rows if not ok]


def test_the_reports_checkpoint_row_fails_when_checkpointing_saves_nothing():
    # A torch under which checkpoint kept every activation (its own saved-tensor hooks lost)
    # measures as the step without it: the transformer's 6.31 MB of activations, 12% of the
    # in-backward peak, are then not saved, and the row must say so.
    import dataclasses

    from hookbench import report

    plain = measure(zoo_workload("transformer"), "in_backward")
    rows = [dataclasses.replace(plain, strategy=label)
            for label in ("in_backward", "in_backward + checkpoint")]
    assert [cells[0] for cells, ok in report.memory_section(rows).rows if not ok] == [
        "in_backward + checkpoint"]


VIT_L_32 = zoo_workload("vit_l_16", batch_size=32)


@pytest.mark.slow
def test_vit_l_at_batch_32_offload_reaches_the_floor_and_with_checkpointing_less_host_memory():
    # Measured on torch 2.14.1, fake backend (baselines/memory/vit_l_16-batch32-fake.json):
    # standard 13.749 GB (9.947 GB of it activations), in backward 13.745 GB, in backward with
    # offload 4.007 GB against a floor of 4.007 GB, the activations 10.593 GB of host memory.
    standard = measure(VIT_L_32, "foreach")
    offloaded = measure(VIT_L_32.replace(offload="lossless"), "in_backward")
    bf16 = measure(VIT_L_32.replace(offload="bf16"), "in_backward")
    assert offloaded.peak <= 1.02 * offloaded.floor  # the target: within 2%
    assert offloaded.peak <= 0.35 * standard.peak  # seen 0.29x: the saving must not be lost
    assert offloaded.host_peak >= 0.9 * standard.peak_breakdown["activations"]
    assert abs(bf16.host_peak / offloaded.host_peak - 0.5) < 0.01
    # With each EncoderBlock checkpointed (seen: 4.825 GB, and 4.231 GB with offload, host
    # 0.665 GB): offload then moves only the 24 blocks' inputs, 1/16 of the host memory it
    # needs alone, for one block's recomputation on the device (+0.224 GB).
    checkpointed = VIT_L_32.replace(checkpointing="repeated")
    both = measure(checkpointed.replace(offload="lossless"), "in_backward")
    assert both.peak < measure(checkpointed, "in_backward").peak
    assert both.host_peak <= 0.1 * offloaded.host_peak


def _gpu_mlp() -> tuple[nn.Module, torch.Tensor]:
    """4 blocks of Linear(1024, 4096), GELU, Linear(4096, 1024) on CUDA (134 MB of fp32
    parameters), a batch of 256, and one step without hooks already run: cuBLAS allocates its
    workspace (32 MiB per handle and stream on sm90, inside the caching allocator, so inside
    ``memory_allocated``) at its first matmul, which must not land in the first measured run."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 4096), nn.GELU(),
                                          nn.Linear(4096, 1024)) for _ in range(4)]).cuda()
    x = torch.randn(256, 1024, device="cuda")
    model(x).square().mean().backward()
    model.zero_grad(set_to_none=True)
    return model, x


def _on_device_after_forward(model: nn.Module, x: torch.Tensor, context) -> tuple[int, list]:
    """The device bytes a forward under ``context`` leaves allocated until backward (what its
    saved tensors cost the device), and the gradients, copied to the host: a copy kept on the
    device would be 134 MB live in the next run's measurement."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with context:
        loss = model(x).square().mean()
    torch.cuda.synchronize()  # the side stream's copies done, their device sources released
    held = torch.cuda.memory_allocated() - before
    loss.backward()
    return held, [p.grad.cpu() for p in model.parameters()]


# Without hooks a forward of _gpu_mlp keeps, per block, the inputs of the two Linears and of the
# GELU: 256 x (1024 + 4096 + 4096) fp32 = 9.4 MB, 37.7 MB for the four (each rounded up to the
# allocator's 512 B, and 2 MiB segments do not enter memory_allocated). Offloaded, the device
# keeps none of them, only the output and the loss (1 MB): a quarter of that is far from both.
OFFLOAD_KEEPS_AT_MOST = 0.25


@pytest.mark.gpu
def test_gpu_offload_on_a_side_stream_is_bit_exact_and_saves_device_memory():
    """The CUDA path: pinned host copies on a side stream (a model big enough that copies and
    compute overlap), gradients bit for bit those without offload, and the device bytes the
    forward leaves for backward a fraction of those without offload."""
    model, x = _gpu_mlp()
    plain, plain_grads = _on_device_after_forward(
        model, x, saved_tensors_hooks(lambda t: t, lambda t: t))
    offload = ActivationOffload(model)
    held, grads = _on_device_after_forward(model, x, offload)
    assert offload.packed > 0
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, grads))
    assert 37e6 < plain and held < OFFLOAD_KEEPS_AT_MOST * plain, (plain, held)
    vit = measure(VIT_L_32.replace(offload="lossless"), "in_backward", backend="cuda")
    plain_vit = measure(VIT_L_32, "in_backward", backend="cuda")
    # fake backend: 4.007 vs 13.745 GB; the GPU adds a cuBLAS workspace per handle and stream
    # (32 MiB on sm90) and the kernels' scratch: 5% is 200 MB of room
    assert vit.peak <= 1.05 * measure(VIT_L_32.replace(offload="lossless"), "in_backward").peak
    assert vit.peak < 0.5 * plain_vit.peak


def _peer(name: str):
    """A peer offload context: torch's ``save_on_cpu`` (pinned), or torchtune's
    ``OffloadActivations`` (an optional peer, its defaults: pinned memory, a side stream, at
    least 1 KB)."""
    if name == "save_on_cpu":
        return torch.autograd.graph.save_on_cpu(pin_memory=True)
    training = pytest.importorskip("torchtune.training", reason="torchtune is an optional peer: "
                                   "pip install -e '.[torchtune]'")
    return training.OffloadActivations()


@pytest.mark.gpu
@pytest.mark.parametrize("peer", ["save_on_cpu", "torchtune"])
def test_gpu_peers_give_the_same_gradients_and_the_memory_side_by_side(peer):
    """The same 4-block MLP under no hooks, hookbench's offload and the peer: the gradients bit
    for bit (every one copies losslessly and computes the same kernels), and the device bytes
    each offload's forward leaves for backward below the step without it. Not the backward's
    peak: ``save_on_cpu`` copies every saved tensor, the Linears' weights too
    (torch/autograd/graph.py), and brings each back to the device in backward, a second copy of
    a 16 MB weight beside the model's own."""
    model, x = _gpu_mlp()
    held, grads = {}, {}
    for name, context in (("none", saved_tensors_hooks(lambda t: t, lambda t: t)),
                          ("hookbench", ActivationOffload(model)), (peer, _peer(peer))):
        held[name], grads[name] = _on_device_after_forward(model, x, context)
    seen = ", ".join(f"{name} {n / 1e6:.1f} MB" for name, n in held.items())
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(*grads.values())), seen
    assert held["hookbench"] < OFFLOAD_KEEPS_AT_MOST * held["none"], seen
    assert held[peer] < held["none"], seen


@pytest.mark.gpu
def test_gpu_torchtune_frees_each_copy_at_its_first_unpack_so_a_retained_graph_fails():
    """A peer difference, pinned: torchtune's ``OffloadActivations`` drops its host copy when
    backward first unpacks it (its tracker entry is deleted), so a second backward through a
    retained graph trips its own assertion, where hookbench's offload brings each tensor back
    again (``test_a_graph_kept_for_a_second_backward_brings_each_tensor_back_twice``)."""
    t = torch.randn(4096, device="cuda", requires_grad=True)
    with _peer("torchtune"):
        loss = (t * 2).sin().sum()
    loss.backward(retain_graph=True)
    with pytest.raises(AssertionError, match="untracked tensor"):
        loss.backward()


def test_torchs_save_on_cpu_as_a_peer_gives_the_same_gradients():
    # On the CPU save_on_cpu keeps a CPU tensor as it is (tensor.cpu() is a no-op), so only
    # the gradients compare here; the GPU tier has the memory side by side.
    model, x = _mlp(), torch.randn(32, 64)
    peer = _grads(model, x, torch.autograd.graph.save_on_cpu(pin_memory=False))
    assert all(torch.equal(a, b) for a, b in zip(_grads(model, x, ActivationOffload(model)), peer))


# slow: 2 ranks twice, about 7 s; the default tier keeps lossless offload bit for bit under
# every single-process strategy, and ZeRO-2's own parity
@pytest.mark.slow
@pytest.mark.distributed
def test_zero2_with_lossless_offload_trains_bit_for_bit_like_without():
    from hookbench.gate import workload_checks

    spec = of(TinySpec(depth=3, width=64, batch_size=16))  # 2 KB activations per rank's share
    rows = workload_checks.zero2([spec.replace(name="plain"),
                                  spec.replace(name="offloaded", offload="lossless")])
    assert not rows["plain/zero2"]["problems"] and not rows["offloaded/zero2"]["problems"]
    assert rows["offloaded/zero2"]["sha256"] == rows["plain/zero2"]["sha256"]
