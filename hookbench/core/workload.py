"""A training step described as data: the one description every part of hookbench reads.

A ``Workload`` says what one step of a training loop is: which model, which data, which loss,
which optimizer, and the settings a real stack runs with (mixed precision, activation
checkpointing, ``torch.compile``). The report, ``record``, ``gate``, ``capture``, the pytest
plugin and the tests all train from it, so a user's own model is checked exactly like the zoo's,
which is itself a set of built-in workloads (``hookbench.models.zoo.workload``)::

    from hookbench import Workload

    WORKLOAD = Workload(
        name="charlm",
        model=CharLM,                                   # zero-argument factory -> nn.Module
        batch=lambda g: make_batch(g),                  # torch.Generator -> (inputs, target)
        loss=lambda output, target: F.cross_entropy(output.flatten(0, 1), target.flatten()),
        optimizer=(torch.optim.AdamW, {"lr": 1e-3}),
        precision="bf16",
    )

Named on the command line by import path (``--workload mypkg.workloads:WORKLOAD``): a
``Workload``, a zero-argument function returning one, or a list of them. ``model()`` must also
build under ``torch.device("meta")`` (the fake memory backend, parameter counts and dtypes are
read from that), and the ZeRO-2 checks pickle the workload into spawned ranks: use
module-level functions there, not lambdas.

``batch`` returns ``(inputs, target)``: inputs a tensor (``model(x)``), a tuple
(``model(*x)``) or a dict (``model(**x)``: ``input_ids``, ``attention_mask``, ...); target what
``loss(output, target)`` takes. Both nest lists, tuples and dicts of tensors, and the ranks
each get their share along the batch (``cut``): a tensor's first dimension, and a list's items,
a list being a batch of samples (a detector's images of different sizes, its target dicts);
tuples and dicts are structure, looked into. Every batch axis must have the same rows.

Options (one field each):
    precision      "fp32"; "bf16": forward and loss under ``torch.autocast(dtype=bfloat16)``;
                   "fp16": under float16 autocast with a ``torch.amp.GradScaler``, where the
                   strategy supports it (the optimizer in backward refuses fp16, in words);
                   "bf16-true", "fp16-true": pure low precision, as torchtune trains by
                   default: the model's floating parameters and buffers cast to that dtype
                   (so its optimizer state is in it too), floating inputs cast to it, no
                   autocast, no fp32 master copy and no loss scaling (torch's GradScaler
                   refuses fp16 gradients). Not with ``compile`` (refused in words)
    checkpointing  "none"; "blocks": every top-level child of the model; "repeated": every
                   instance of the first module class (in module order) that has children
                   and more than one instance, torch's containers aside (a transformer's
                   layer, a ResNet's block: what Hugging Face's
                   ``gradient_checkpointing_enable`` checkpoints); a module class (or a tuple
                   of them, e.g. ``GPT2Block``) or a ``re.compile()``d pattern matched against
                   the full module names (``re.compile(r"blocks\\.\\d+")``): every matching
                   module not inside another one. Each runs under
                   ``torch.utils.checkpoint(use_reentrant=...)``
    use_reentrant  False (torch's recommendation), or True: the checkpointing above runs
                   reentrant, as older code and some libraries still do. Held to the plain step
                   like any checkpointing (``name/transform``): a reentrant block whose inputs
                   need no gradient gives its parameters none, and that row fails saying so;
                   ZeRO-2 refuses it in words
    compile        None, or a ``torch.compile`` backend name ("eager", "inductor"), compiled in
                   place (``Module.compile``) so that parameter names do not change
    param_groups   None (every parameter, the optimizer's options), or a function of the model
                   returning torch param groups, e.g. no weight decay on biases and norms
    lr_scheduler   None, or (a torch.optim.lr_scheduler class, its options), stepped after
                   every optimizer step
    clip_grad_norm None, or the max global gradient norm (``clip_grad_norm_`` before each
                   step) where the strategy supports it; the optimizer in backward refuses it
    offload        None; "lossless", "bf16", "int8": forward and loss under
                   ``hookbench.mechanisms.activation_offload.ActivationOffload`` (saved activations in
                   host memory until backward; "bf16"/"int8": compressed)
    ddp            None (hookbench's choice: ``find_unused_parameters=True``, buffers not synced,
                   so that BatchNorm statistics stay each rank's own as under ZeRO-2 and
                   FSDP2), or the keyword arguments the team passes to torch's
                   ``DistributedDataParallel``, run exactly as given, torch's defaults for the
                   rest: ``static_graph``, ``find_unused_parameters``,
                   ``gradient_as_bucket_view``, ``bucket_cap_mb``, ``broadcast_buffers``
                   (``forward_sync_buffers`` from torch 2.14), ...; and ``comm_hook``, the
                   team's communication hook as ``register_comm_hook`` takes it (e.g.
                   ``default_hooks.bf16_compress_hook``), with ``comm_state``, a function of
                   no arguments making its state on each rank (e.g. a ``functools.partial``
                   of ``PowerSGDState``; default: None, the default group). Not ``module``,
                   ``device_ids``, ``output_device``, ``process_group`` or ``device_mesh``:
                   where DDP runs is hookbench's
    fsdp2          None (hookbench's choice: each repeated block a unit, then the root; the
                   rows' own ``reshard_after_forward``, ZeRO-2 False and ZeRO-3 True; under
                   bf16 ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``),
                   or what the team passes to ``fully_shard``, run exactly as given on every
                   FSDP2 row: ``units`` (a module class, a tuple of them, or a
                   ``re.compile()``d pattern over module names: every match is sharded as a
                   unit, then the root, as torchtitan's ``for layer in model.layers``),
                   ``mp_policy`` (a ``MixedPrecisionPolicy``), ``reshard_after_forward`` (a
                   bool, or an int: the size to reshard to) and ``offload_policy`` (e.g.
                   ``CPUOffloadPolicy()``)
    deepspeed      None (hookbench's choice: ZeRO stage 2, fp32, every setting that matters
                   stated, ``hookbench.measure.peers.deepspeed_zero2.config``), or the team's
                   DeepSpeed config (the dict ``deepspeed.initialize(config=...)`` takes),
                   merged over that choice, key by key inside ``zero_optimization``, for the
                   DeepSpeed row (the peers extra). Not what the workload itself says: the
                   batch sizes and accumulation, ``optimizer``, ``scheduler``,
                   ``gradient_clipping``, nor DeepSpeed's ``fp16``/``bf16``/``amp`` modes
                   (bf16 parameters with fp32 masters, not the workload's precision); the
                   stage is 2
    seed           the model's initialisation, the data, and the random numbers the forward
                   draws (dropout, masks): every forward of batch ``i`` (a ZeRO-2 rank's: of
                   its share ``r``) runs on the global RNGs (torch's, numpy's and Python's
                   ``random``) seeded from (seed, i, r) and restored after it, so every
                   strategy draws the same masks and a ZeRO-2 rank draws the ones the
                   single-process reference draws for that share
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib
import inspect
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn
import torch.utils.checkpoint
from torch.utils._pytree import tree_map_only

try:  # not a dependency of torch's: where it is absent, no model can draw from it
    import numpy as np
except ImportError:  # pragma: no cover
    np = None

from hookbench.core import draws, fsdp
from hookbench.core.prerequisites import one_line
from hookbench.mechanisms.activation_offload import ActivationOffload

__all__ = ["CHECKPOINTING", "OFFLOAD", "PRECISIONS", "PURE", "Workload", "checkpointed",
           "configured", "describe", "load", "of", "seeded_rngs", "to_device"]

PRECISIONS = ("fp32", "bf16", "fp16", "bf16-true", "fp16-true")
CHECKPOINTING = ("none", "blocks", "repeated")
OFFLOAD = (None, "lossless", "bf16", "int8")
_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Pure low precision: the dtype the whole model trains in (``Workload.pure``).
PURE = {"bf16-true": torch.bfloat16, "fp16-true": torch.float16}


@dataclass(frozen=True, eq=False)
class Workload:
    """One training step: model, data, loss, optimizer and the stack's settings."""

    name: str
    model: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], tuple[Any, torch.Tensor]]
    loss: Callable[[Any, torch.Tensor], torch.Tensor]
    optimizer: tuple[type[torch.optim.Optimizer], dict[str, Any]] = (torch.optim.Adam,
                                                                      {"lr": 1e-3})
    precision: str = "fp32"
    checkpointing: str = "none"
    use_reentrant: bool = False
    compile: str | None = None
    seed: int = 0
    param_groups: Callable[[nn.Module], list[dict[str, Any]]] | None = None
    lr_scheduler: tuple[type, dict[str, Any]] | None = None
    clip_grad_norm: float | None = None
    offload: str | None = None
    ddp: dict[str, Any] | None = None
    fsdp2: dict[str, Any] | None = None
    deepspeed: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            # Baseline rows are keyed "name/what"; a slash would make two workloads collide.
            raise ValueError(f"Workload name must be a non-empty string without '/', "
                             f"got {self.name!r}")
        for field in ("model", "batch", "loss"):
            if not callable(getattr(self, field)):
                raise TypeError(f"Workload {self.name!r}: {field} must be callable, got "
                                f"{type(getattr(self, field)).__name__}")
        cls, kwargs = _pair(self.optimizer, self.name, "optimizer")
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise TypeError(f"Workload {self.name!r}: optimizer must be (a torch.optim."
                            f"Optimizer class, a dict of its options), got {cls!r}")
        if not isinstance(kwargs, dict):
            raise TypeError(f"Workload {self.name!r}: the optimizer's options must be a dict, "
                            f"got {type(kwargs).__name__}")
        if kwargs.get("differentiable"):
            # It steps in grad mode, to differentiate through the step (meta-learning on
            # tensors that are not leaves): on a module's parameters, leaves that require grad,
            # torch's in-place update raises at the first step, on every strategy alike.
            raise ValueError(f"Workload {self.name!r}: the optimizer's differentiable=True "
                             f"steps in grad mode, and torch cannot update a module's "
                             f"parameters in place there (\"a leaf Variable that requires grad "
                             f"is being used in an in-place operation\"); leave it out")
        if self.precision not in PRECISIONS:
            raise ValueError(f"Workload {self.name!r}: precision must be one of {PRECISIONS}, "
                             f"got {self.precision!r}")
        _selector(self.checkpointing, self.name)
        if not isinstance(self.use_reentrant, bool):
            raise TypeError(f"Workload {self.name!r}: use_reentrant must be a bool, got "
                            f"{self.use_reentrant!r}")
        if self.use_reentrant and self.checkpointing == "none":
            raise ValueError(f"Workload {self.name!r}: use_reentrant=True says how checkpointing "
                             f"runs, and checkpointing is 'none'; choose the blocks to "
                             f"checkpoint, or leave use_reentrant out")
        if self.param_groups is not None and not callable(self.param_groups):
            raise TypeError(f"Workload {self.name!r}: param_groups must be a function of the "
                            f"model returning param groups, got {self.param_groups!r}")
        if self.lr_scheduler is not None:
            scheduler, options = _pair(self.lr_scheduler, self.name, "lr_scheduler")
            if not (isinstance(scheduler, type) and isinstance(options, dict)
                    and issubclass(scheduler, torch.optim.lr_scheduler.LRScheduler)):
                raise TypeError(f"Workload {self.name!r}: lr_scheduler must be (a torch.optim."
                                f"lr_scheduler class, a dict of its options), got "
                                f"{self.lr_scheduler!r}")
        if self.offload not in OFFLOAD:
            raise ValueError(f"Workload {self.name!r}: offload must be one of {OFFLOAD}, got "
                             f"{self.offload!r}")
        if self.clip_grad_norm is not None and (
                isinstance(self.clip_grad_norm, bool)
                or not isinstance(self.clip_grad_norm, (int, float))
                or not 0 < self.clip_grad_norm < float("inf")):
            raise ValueError(f"Workload {self.name!r}: clip_grad_norm must be None or a "
                             f"positive number, got {self.clip_grad_norm!r}")
        if self.compile is not None and not (isinstance(self.compile, str) and self.compile):
            raise TypeError(f"Workload {self.name!r}: compile must be None or a torch.compile "
                            f"backend name, got {self.compile!r}")
        _ddp_options(self.ddp, self.name)
        _fsdp2_options(self.fsdp2, self.name)
        _deepspeed_config(self.deepspeed, self.name)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"Workload {self.name!r}: seed must be an int >= 0")
        if self.pure is not None and self.compile is not None:
            # Inductor keeps fused low-precision chains in fp32 between ops, eager rounds
            # after each: another arithmetic, and in bf16 one rounding is a whole small update,
            # so no comparison between strategies would say anything.
            raise ValueError(f"Workload {self.name!r}: precision={self.precision!r} with "
                             f"compile={self.compile!r} is not supported: compiled low-"
                             f"precision code rounds elsewhere than eager code, by as much as "
                             f"an update; check the pure-precision workload eager")

    def replace(self, **changes: Any) -> Workload:
        """This workload with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def build(self) -> nn.Module:
        """A new model, the same on every call: built from ``seed`` with the global RNG left
        as it was, with activation checkpointing and compilation applied."""
        with seeded_rngs(self.seed), draws.pinned(self.name):
            model = self.model()
        if not isinstance(model, nn.Module):
            raise TypeError(f"Workload {self.name!r}: model() must return an nn.Module, got "
                            f"{type(model).__name__}")
        if self.checkpointing != "none":
            blocks = checkpointed(model, self.checkpointing)
            if not blocks:
                raise ValueError(f"Workload {self.name!r}: checkpointing="
                                 f"{describe(self.checkpointing)} selects no module of "
                                 f"{type(model).__name__}")
            for block in blocks:
                # An instance attribute: Module.__call__ (and its hooks) run as before, only
                # the block's own forward is recomputed in backward (its draws pinned as
                # its forward's were: ``hookbench.core.draws``).
                block.forward = functools.partial(torch.utils.checkpoint.checkpoint,
                                                  block.forward,
                                                  use_reentrant=self.use_reentrant)
        if self.pure is not None:
            model.to(self.pure)  # parameters and buffers: the optimizer state follows them
        if self.compile is not None:
            model.compile(backend=self.compile)  # in place: parameter names stay as they are
        return model

    @property
    def pure(self) -> torch.dtype | None:
        """The dtype a pure low-precision workload trains in (``PURE``), else None."""
        return PURE.get(self.precision)

    def data(self, index: int) -> tuple[Any, torch.Tensor]:
        """The ``index``-th (inputs, target), the same on every call."""
        g = torch.Generator().manual_seed(self.seed * 100_003 + index)
        # a batch function that draws globally, or from the generator it is given
        with seeded_rngs(self.seed * 100_003 + index), draws.pinned(self.name):
            got = self.batch(g)
        if not (isinstance(got, tuple) and len(got) == 2):
            raise TypeError(f"Workload {self.name!r}: batch(generator) must return "
                            f"(inputs, target), got {type(got).__name__}")
        inputs, target = got
        for what, value in (("inputs", inputs), ("target", target)):
            odd = next((f"{path}: {type(leaf).__name__}" for path, leaf in _leaves(value, what)
                        if not torch.is_tensor(leaf)), None)
            if odd:
                raise TypeError(f"Workload {self.name!r}: inputs and target must be tensors, "
                                f"or lists, tuples and dicts of them (nested), got {odd}")
        if self.pure is not None:  # what a pure-bf16 model is fed; token ids stay as they are
            inputs = _apply(inputs, lambda t: t.to(self.pure) if t.is_floating_point() else t)
        return inputs, target

    def check(self, shares: int = 1, batches: int = 1) -> None:
        """Build the model and run the forward and loss of batches 0 to ``batches`` - 1 (as
        many as the checks will draw), before anything is measured, so that a broken workload
        is told once and not on every row, nor recorded as a failure of torch's: a
        ``ValueError`` in one line naming the workload, the function, the batch and the
        problem (a factory, batch function, forward or loss that raises; a batch that does
        not split over ``shares`` data-parallel ranks; a loss that is not a finite scalar
        depending on the parameters; low-precision parameters the precision does not
        declare). A compiled workload is checked eager (compiling takes
        long)."""
        eager = self.replace(compile=None)
        try:  # built under torch.device("meta") first: parameter counts and dtypes read so
            dtype = self.parameter_dtype
        except Exception as e:  # noqa: BLE001 - the user's factory: where it fails, said
            self._call("model()", self.model)  # fails on the CPU too: said so
            raise ValueError(f"workload {self.name!r}: model() raised {one_line(e)} under "
                             f"torch.device('meta') only (it builds on the CPU): hookbench "
                             f"reads parameter counts and dtypes from a meta build and runs its "
                             f"fake memory backend on one; make the factory build there (no "
                             f"weights read or copied in it, no .to() a device)") from None
        if self.pure is not None and any(d.is_complex for d in self.parameter_dtypes_built):
            raise ValueError(f"workload {self.name!r}: model() builds complex parameters under "
                             f"precision={self.precision!r}; torch has no complex "
                             f"{str(self.pure).removeprefix('torch.')} to cast them to: train "
                             f"them in 'fp32' (complex64), or autocast ('bf16', 'fp16')")
        if self.pure is None and dtype.to_real() not in (torch.float32, torch.float64):
            # float32's tolerances would be a whole bf16 rounding too tight
            raise ValueError(f"workload {self.name!r}: model() builds parameters in "
                             f"{str(dtype).removeprefix('torch.')} under precision="
                             f"{self.precision!r}; declare precision='bf16-true' or "
                             f"'fp16-true' (pure low precision: the model and its inputs are "
                             f"cast), or build in float32 for autocast ('bf16', 'fp16')")
        model = self._call("model()", eager.build)
        for index in range(batches):
            self._check_batch(model, index, shares)

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - the user's function: say which raised
            raise ValueError(f"workload {self.name!r}: {what} raised {one_line(e)}") from None

    def _check_batch(self, model: nn.Module, index: int, shares: int) -> None:
        call = self._call
        at = f" at batch {index}" if index else ""
        inputs, target = call(f"batch(generator){at}", self.data, index)
        axes = [*batch_axes(target, "target"), *batch_axes(inputs, "inputs")]
        rows = axes[0][1] if axes else 0
        if rows % shares or rows < shares:
            raise ValueError(f"workload {self.name!r}: batch(generator) gives a batch of "
                             f"{rows} rows ({axes[0][0] if axes else 'no tensor'}), which "
                             f"does not split over {shares} data-parallel ranks; make the "
                             f"batch a multiple of {shares}")
        for path, n in axes:
            if n != rows:
                raise ValueError(f"workload {self.name!r}: batch(generator)'s {path} has "
                                 f"{n} rows, {axes[0][0]} {rows}: each is cut along its batch "
                                 f"(a tensor's first dimension, a list's items) for the ranks")
        with self.forward_rng(index), self.autocast("cpu"):
            output = call(f"the model's forward{at}", self.forward, model, inputs)
            loss = call(f"loss(output, target){at}", self.loss, output, target)
        if not torch.is_tensor(loss) or loss.numel() != 1 or loss.dim() > 0:
            what = (f"a tensor of shape {tuple(loss.shape)}" if torch.is_tensor(loss)
                    else type(loss).__name__)
            raise ValueError(f"workload {self.name!r}: loss(output, target) returned {what}, "
                             f"not a scalar tensor (reduce it, e.g. with .mean())")
        if not torch.isfinite(loss.detach()).item():
            raise ValueError(f"workload {self.name!r}: loss(output, target) is "
                             f"{float(loss.detach())} on batch {index}, before any step: nothing "
                             f"can be compared (check the model's initialisation and inputs)")
        if not loss.requires_grad:
            raise ValueError(f"workload {self.name!r}: loss(output, target) does not depend "
                             f"on any parameter (no gradient would flow)")

    @property
    def batch_size(self) -> int:
        axes = batch_axes(self.data(0), "batch")
        return axes[0][1] if axes else 0

    def optimizer_params(self, model: nn.Module) -> list[dict[str, Any]] | None:
        """The param groups ``param_groups(model)`` returns, or None: every parameter."""
        if self.param_groups is None:
            return None
        groups = list(self.param_groups(model))
        if not groups or not all(isinstance(g, dict) and "params" in g for g in groups):
            raise TypeError(f"Workload {self.name!r}: param_groups(model) must return a "
                            f"non-empty list of dicts with 'params', got {groups!r:.200}")
        return [{**g, "params": list(g["params"])} for g in groups]

    def scheduler(self, optimizer: Any) -> Any:
        """The LR scheduler over ``optimizer``'s param groups, or None."""
        if self.lr_scheduler is None:
            return None
        cls, options = self.lr_scheduler
        return cls(optimizer, **options)

    @contextlib.contextmanager
    def forward_rng(self, index: int, share: int = 0,
                    device: str | torch.device = "cpu") -> Iterator[None]:
        """Every global RNG a forward draws from (``seeded_rngs``: torch's CPU generator and
        ``device``'s if CUDA, numpy's and Python's) seeded from (seed, index, share), restored
        on exit: what the forward of batch ``index``'s ``share`` draws from."""
        digest = hashlib.sha256(f"{self.seed}/{index}/{share}".encode()).digest()
        with (seeded_rngs(int.from_bytes(digest[:8], "little") >> 1, device),
              draws.pinned(self.name, compiled=self.compile is not None)):
            yield

    @property
    def parameter_dtype(self) -> torch.dtype:
        """The dtype of the model's first parameter as trained (parity tolerances are per
        dtype): a pure precision's dtype, else what ``model()`` builds."""
        if self.pure is not None:
            return self.pure
        with torch.device("meta"):
            return next(self.model().parameters()).dtype

    def meta_model(self) -> nn.Module:
        """``model()`` built under ``torch.device("meta")`` and cast as trained (a pure
        precision's dtype): its parameters' shapes and dtypes, without their memory."""
        with torch.device("meta"):
            model = self.model()
        return model if self.pure is None else model.to(self.pure)

    @property
    def parameter_dtypes_built(self) -> set[torch.dtype]:
        """The dtypes of the trainable parameters ``model()`` builds (complex ones beside real
        ones in a Fourier layer), before a pure precision casts them."""
        with torch.device("meta"):
            return {p.dtype for p in self.model().parameters() if p.requires_grad}

    @property
    def parameter_dtypes(self) -> set[torch.dtype]:
        """The dtypes of the trainable parameters as trained."""
        return {self.pure} if self.pure is not None else self.parameter_dtypes_built

    def autocast(self, device: str | torch.device) -> contextlib.AbstractContextManager:
        """The precision's autocast region for forward and loss (nothing for fp32 and the
        pure precisions)."""
        if self.precision not in _AUTOCAST:
            return contextlib.nullcontext()
        return torch.autocast(torch.device(device).type, dtype=_AUTOCAST[self.precision])

    def grad_scaler(self, device: str | torch.device) -> torch.amp.GradScaler | None:
        """A fresh GradScaler for fp16, else None."""
        if self.precision != "fp16":
            return None
        return torch.amp.GradScaler(torch.device(device).type)

    def compute_loss(self, model: nn.Module, inputs: Any, target: torch.Tensor,
                     key: tuple[int, int] | None = None) -> torch.Tensor:
        """Forward and loss under the precision's autocast; with ``key`` (batch index, share)
        on the RNG ``forward_rng`` seeds for it."""
        device = next((t.device for _, t in _leaves((target, inputs), "batch")), "cpu")
        rng = contextlib.nullcontext() if key is None else self.forward_rng(*key, device=device)
        offload = (contextlib.nullcontext() if self.offload is None else ActivationOffload(
            model, compress=None if self.offload == "lossless" else self.offload))
        with rng, self.autocast(device), offload:
            return self.loss(self.forward(model, inputs), target)

    @staticmethod
    def forward(model: nn.Module, inputs: Any) -> Any:
        """``model`` on ``inputs``: ``model(x)``, ``model(*x)`` for a tuple, ``model(**x)`` for
        a dict."""
        if isinstance(inputs, dict):
            return model(**inputs)
        return model(*inputs) if isinstance(inputs, tuple) else model(inputs)


@contextlib.contextmanager
def seeded_rngs(seed: int, device: str | torch.device = "cpu") -> Iterator[None]:
    """Every global random number generator a model's code draws from, seeded from ``seed``
    and restored on exit, also on error: torch's CPU generator (and ``device``'s if it is
    CUDA), numpy's global ``np.random`` (wav2vec2's and HuBERT's SpecAugment masks draw from
    it inside the forward) and Python's ``random``. Forking only torch's would let two runs of
    the same step draw different masks, and a strategy compared with its reference would fail
    on a difference that is not the strategy's."""
    device = torch.device(device)
    cuda = [device] if device.type == "cuda" else []
    python_state = random.getstate()
    numpy_state = np.random.get_state() if np is not None else None
    try:
        with torch.random.fork_rng(devices=cuda):
            torch.default_generator.manual_seed(seed)
            if cuda:
                with torch.cuda.device(device):
                    torch.cuda.manual_seed(seed)
            random.seed(seed)
            if np is not None:
                np.random.seed(seed % 2**32)  # numpy's legacy seed takes 32 bits
            yield
    finally:
        random.setstate(python_state)
        if numpy_state is not None:
            np.random.set_state(numpy_state)


def _pair(pair: Any, name: str, field: str) -> tuple[Any, Any]:
    if not (isinstance(pair, tuple) and len(pair) == 2):
        raise TypeError(f"Workload {name!r}: {field} must be a (class, kwargs) pair, e.g. "
                        f"(torch.optim.AdamW, {{'lr': 1e-3}}), got {pair!r}")
    return pair


# Where DDP runs and over which ranks: hookbench's to choose, not a setting of the workload's.
_DDP_PLACEMENT = ("module", "device_ids", "output_device", "process_group", "device_mesh")
# The keys of ``ddp`` that are not DDP's keyword arguments: the team's communication hook and a
# function making its state on each rank (``hookbench.engines.ddp``)
DDP_HOOK_KEYS = ("comm_hook", "comm_state")


def _ddp_options(options: Any, name: str) -> None:
    """Validate ``ddp``: None or a dict of ``DistributedDataParallel``'s keyword arguments on
    this torch, placement aside."""
    if options is None:
        return
    if not (isinstance(options, dict) and all(isinstance(k, str) for k in options)):
        raise TypeError(f"Workload {name!r}: ddp must be None or a dict of "
                        f"DistributedDataParallel's keyword arguments, got {options!r}")
    from torch.nn.parallel import DistributedDataParallel

    accepted = set(inspect.signature(DistributedDataParallel).parameters) - set(_DDP_PLACEMENT)
    placement = sorted(set(options) & set(_DDP_PLACEMENT))
    if placement:
        raise ValueError(f"Workload {name!r}: ddp sets {placement}: where DDP runs and over "
                         f"which ranks is hookbench's (gloo ranks on CPU, a GPU each on "
                         f"CUDA); leave them out")
    unknown = sorted(set(options) - accepted - set(DDP_HOOK_KEYS))
    if unknown:
        raise ValueError(f"Workload {name!r}: ddp has {unknown}, which torch "
                         f"{torch.__version__}'s DistributedDataParallel does not take; it "
                         f"takes {sorted(accepted)}, and a comm hook as 'comm_hook' (with "
                         f"'comm_state', a function making its state on each rank)")
    for key, what in (("comm_hook", "a function (state, bucket) -> Future, as "
                                    "register_comm_hook takes"),
                      ("comm_state", "a function of no arguments returning the hook's state")):
        if key in options and not callable(options[key]):
            raise TypeError(f"Workload {name!r}: ddp[{key!r}] must be {what}, got "
                            f"{options[key]!r}")
    if "comm_state" in options and "comm_hook" not in options:
        raise ValueError(f"Workload {name!r}: ddp declares a comm_state and no comm_hook; "
                         f"declare the hook it is for, or leave comm_state out")


# What fully_shard takes from a team (Workload.fsdp2), and of which type; the mesh is hookbench's.
_FSDP2_TYPES = {"mp_policy": "MixedPrecisionPolicy", "offload_policy": "OffloadPolicy"}


def _fsdp2_options(options: Any, name: str) -> None:
    """Validate ``fsdp2``: None or a dict of ``units``, ``mp_policy``, ``reshard_after_forward``
    and ``offload_policy``, each of the type ``fully_shard`` takes."""
    if options is None:
        return
    if not (isinstance(options, dict) and all(isinstance(k, str) for k in options)):
        raise TypeError(f"Workload {name!r}: fsdp2 must be None or a dict of fully_shard's "
                        f"settings, got {options!r}")
    known = {"units", "reshard_after_forward", *_FSDP2_TYPES}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"Workload {name!r}: fsdp2 has {unknown}; it takes {sorted(known)} "
                         f"(the mesh is hookbench's: gloo ranks on CPU, a GPU each on CUDA)")
    if "units" in options:
        units = options["units"]
        classes = units if isinstance(units, tuple) else (units,)
        if not (isinstance(units, re.Pattern) or classes and all(
                isinstance(c, type) and issubclass(c, nn.Module) for c in classes)):
            raise TypeError(f"Workload {name!r}: fsdp2's units must be a module class, a tuple "
                            f"of them or a re.compile()d pattern over module names, got "
                            f"{units!r}")
    reshard = options.get("reshard_after_forward", True)
    if not isinstance(reshard, int):  # a bool is an int
        raise TypeError(f"Workload {name!r}: fsdp2's reshard_after_forward must be a bool or "
                        f"an int, got {reshard!r}")
    if not isinstance(reshard, bool) and reshard < 1:
        raise ValueError(f"Workload {name!r}: fsdp2's reshard_after_forward as an int is the "
                         f"number of ranks to reshard to, at least 1, got {reshard}")
    for key, type_name in _FSDP2_TYPES.items():
        if key not in options:
            continue
        if not isinstance(options[key], getattr(fsdp.api(), type_name)):
            raise TypeError(f"Workload {name!r}: fsdp2's {key} must be a torch.distributed.fsdp."
                            f"{type_name}, got {options[key]!r}")


# What the workload says already, so its DeepSpeed config may not say it again (``deepspeed``)
_DEEPSPEED_OWNED = {
    "train_batch_size": "the batch size is the workload's (its batch function), shared by the "
                        "ranks",
    "train_micro_batch_size_per_gpu": "the batch size is the workload's, shared by the ranks",
    "gradient_accumulation_steps": "the engines' rows accumulate hookbench's micro-batches",
    "optimizer": "the optimizer is the workload's (Workload.optimizer)",
    "scheduler": "the schedule is the workload's (Workload.lr_scheduler)",
    "gradient_clipping": "clipping is the workload's (Workload.clip_grad_norm)",
    "fp16": "DeepSpeed's fp16 mode trains fp16 parameters with fp32 masters, not the "
            "workload's precision",
    "bf16": "DeepSpeed's bf16 mode trains bf16 parameters with fp32 masters, not the "
            "workload's precision",
    "amp": "the precision is the workload's (Workload.precision)",
}


def _deepspeed_config(config: Any, name: str) -> None:
    """Validate ``deepspeed``: None or a DeepSpeed config dict saying nothing the workload says
    (``_DEEPSPEED_OWNED``), ZeRO stage 2."""
    if config is None:
        return
    if not (isinstance(config, dict) and all(isinstance(k, str) for k in config)):
        raise TypeError(f"Workload {name!r}: deepspeed must be None or a DeepSpeed config dict, "
                        f"got {config!r}")
    owned = sorted(set(config) & set(_DEEPSPEED_OWNED))
    if owned:
        raise ValueError(f"Workload {name!r}: deepspeed sets {owned}: "
                         f"{_DEEPSPEED_OWNED[owned[0]]}; leave {owned[0]!r} out")
    zero = config.get("zero_optimization", {})
    if not (isinstance(zero, dict) and all(isinstance(k, str) for k in zero)):
        raise TypeError(f"Workload {name!r}: deepspeed's zero_optimization must be a dict, got "
                        f"{zero!r}")
    if zero.get("stage", 2) != 2:
        raise ValueError(f"Workload {name!r}: deepspeed's zero_optimization stage is "
                         f"{zero['stage']!r}; the DeepSpeed row is ZeRO stage 2")


def describe(selector: Any) -> str:
    """A ``checkpointing`` selector in words: the keyword, the classes, the pattern."""
    if isinstance(selector, tuple):
        return f"({', '.join(c.__name__ for c in selector)})"
    if isinstance(selector, re.Pattern):
        return f"re.compile({selector.pattern!r})"
    return selector.__name__ if isinstance(selector, type) else repr(selector)


def _selector(selector: Any, name: str) -> None:
    """Validate ``checkpointing``: a keyword, a module class or tuple of them, or a compiled
    regular expression (a plain string is a keyword, so that a typo is not a pattern)."""
    classes = selector if isinstance(selector, tuple) else (selector,)
    if classes and all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        return
    if isinstance(selector, re.Pattern):
        return
    if isinstance(selector, str):
        if selector not in CHECKPOINTING:
            raise ValueError(f"Workload {name!r}: checkpointing must be one of {CHECKPOINTING}, "
                             f"a module class or a re.compile()d pattern over module names, "
                             f"got {selector!r}")
        return
    raise TypeError(f"Workload {name!r}: checkpointing must be one of {CHECKPOINTING}, a "
                    f"module class (or a tuple of them) or a re.compile()d pattern over module "
                    f"names, got {selector!r}")


def checkpointed(model: nn.Module, selector: Any) -> list[nn.Module]:
    """The modules ``selector`` picks, outermost first, none inside another one picked (a
    checkpoint inside a checkpoint would recompute the inner block twice)."""
    if selector == "blocks":
        return list(model.children())
    if selector == "repeated":
        # torch's own containers are not blocks: a ModuleList is never called, and a plain
        # Sequential holds a whole stack as often as one block's layers.
        blocks = [type(m) for m in model.modules() if next(m.children(), None) is not None
                  and type(m) not in (nn.Sequential, nn.ModuleList, nn.ModuleDict)]
        selector = next((c for c in blocks if blocks.count(c) > 1), None)
        if selector is None:
            return []
    if isinstance(selector, re.Pattern):
        chosen = lambda name, m: bool(name) and selector.fullmatch(name)  # noqa: E731
    else:
        chosen = lambda name, m: isinstance(m, selector)  # noqa: E731
    picked: list[str] = []
    out = []
    for name, module in model.named_modules():
        if any(name.startswith(p + ".") for p in picked):
            continue
        if chosen(name, module):
            picked.append(name)
            out.append(module)
    return out


def to_device(inputs: Any, device: str | torch.device) -> Any:
    """Inputs (tensors, nested in lists, tuples and dicts) on ``device``."""
    return _apply(inputs, lambda t: t.to(device))


def _apply(inputs: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``fn`` on each tensor of inputs (nested in lists, tuples and dicts)."""
    return tree_map_only(torch.Tensor, fn, inputs)


def _leaves(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    """Each leaf of ``value`` (lists, tuples and dicts looked into) with its path in words."""
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _leaves(item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, f"{path}[{key!r}]")
    else:
        yield path, value


def batch_axes(value: Any, path: str = "batch") -> list[tuple[str, int]]:
    """Each batch axis of ``value`` with its rows, in order: a tensor's first dimension (0 for
    a scalar, which cannot be cut), a list's items (a batch of samples, not looked into);
    tuples and dicts are structure, looked into."""
    if isinstance(value, list):
        return [(path, len(value))]
    if isinstance(value, (tuple, dict)):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        return [axis for key, item in items for axis in batch_axes(
            item, f"{path}[{key!r}]" if isinstance(value, dict) else f"{path}[{key}]")]
    return [(path, len(value) if value.dim() else 0)]


def cut(value: Any, share: slice) -> Any:
    """``value``'s rows ``share`` along every batch axis (``batch_axes``): a tensor's, a
    list's items; tuples (named ones too) and dicts keep their structure."""
    if isinstance(value, (list, torch.Tensor)):
        return value[share]
    if isinstance(value, dict):
        return type(value)((k, cut(v, share)) for k, v in value.items())
    if isinstance(value, tuple):
        items = [cut(v, share) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    raise TypeError(f"cannot cut {type(value).__name__} along a batch")


def of(spec: Any) -> Workload:
    """``spec`` as a Workload: a Workload itself, or anything with ``workload()`` (TinySpec)."""
    if isinstance(spec, Workload):
        return spec
    if callable(getattr(spec, "workload", None)):
        return spec.workload()
    raise TypeError(f"expected a hookbench.Workload, got {type(spec).__name__}")


def load(path: str, root: str | Path = ".") -> list[Workload]:
    """The workloads named by ``package.module:attribute``: a Workload, a list or tuple of
    them, or a zero-argument function returning either. ``root`` (the user's project) goes on
    ``sys.path`` first, as the current folder does for ``python -m``; it stays there, so that
    spawned ZeRO-2 ranks can import the workload's functions too."""
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"--workload {path!r}: expected package.module:attribute")
    root = str(Path(root).resolve())
    if root not in sys.path:
        sys.path.insert(0, root)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"--workload {path}: cannot import {module_name} ({e})") from None
    try:
        found = functools.reduce(getattr, attribute.split("."), module)
    except AttributeError:
        raise ValueError(f"--workload {path}: {module_name} has no attribute "
                         f"{attribute!r}") from None
    if callable(found) and not isinstance(found, Workload):
        found = found()
    found = list(found) if isinstance(found, (list, tuple)) else [found]
    if not found or not all(isinstance(w, Workload) for w in found):
        raise TypeError(f"--workload {path}: expected a hookbench.Workload, a list of them or "
                        f"a function returning either, got "
                        f"{', '.join(sorted({type(w).__name__ for w in found})) or 'nothing'}")
    return found


def configured(start: str | Path = ".") -> dict[str, Any]:
    """The ``[tool.hookbench]`` table of the nearest pyproject.toml at or above ``start``:
    ``workloads`` (import paths) and ``baseline`` (a path, relative to that file), or {}."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    for folder in (Path(start).resolve(), *Path(start).resolve().parents):
        pyproject = folder / "pyproject.toml"
        if not pyproject.is_file():
            continue
        try:
            table = tomllib.loads(pyproject.read_text()).get("tool", {}).get("hookbench", {})
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{pyproject}: {e}") from None
        unknown = set(table) - {"workloads", "baseline"}
        if unknown:
            raise ValueError(f"{pyproject}: [tool.hookbench] has unknown keys {sorted(unknown)}; "
                             f"it takes workloads and baseline")
        workloads = table.get("workloads", [])
        if not (isinstance(workloads, list) and all(isinstance(w, str) for w in workloads)):
            raise ValueError(f"{pyproject}: [tool.hookbench] workloads must be a list of "
                             f"import paths (package.module:attribute)")
        out: dict[str, Any] = {"workloads": workloads, "root": folder}
        if "baseline" in table:
            out["baseline"] = str(folder / table["baseline"])
        return out if table else {}
    return {}

