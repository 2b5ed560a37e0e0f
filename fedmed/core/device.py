"""Where a site computes and at what precision: ``train.device`` and ``train.precision``.

``train.device``: ``auto`` (a CUDA GPU when this machine has one, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``; a
site may override it in its own settings (``"device"`` in ``local/fedmed_site.json``, or ``FEDMED_DEVICE``) — which
GPU it has is the site's business. ``cuda`` on a machine without one is a :class:`DeviceError` of one line naming the
site, raised at its first task, before it trains anything.

``train.precision``: ``fp32``; ``bf16`` (``torch.autocast`` with bfloat16 — on the CPU too); ``fp16`` (autocast with
float16 and, on a GPU, a ``GradScaler`` so that small gradients do not underflow). Parameters, optimizer state and
everything that leaves a site stay float32 (``get_params``).
"""

from __future__ import annotations

from fedmed.core.errors import FedmedError

import contextlib
import re

import torch

__all__ = ["DeviceError", "PRECISIONS", "autocast", "backward_step", "backward_step_on_device", "fused_kwargs",
           "grad_scaler", "grads_finite", "model_device", "nonfinite_flag", "resolve_device", "to_channels_last",
           "uses_channels_last"]

PRECISIONS = ("fp32", "bf16", "fp16")
DEVICE_PATTERN = r"^(auto|cpu|cuda(:\d+)?)$"


class DeviceError(FedmedError, RuntimeError):
    """A device this machine does not have; the message names the site and the setting."""


def resolve_device(spec: str = "auto", *, where: str = "this machine", setting: str = "train.device") -> torch.device:
    """The ``torch.device`` of a ``train.device`` value (see the module notes); messages name ``where`` and
    ``setting``."""
    spec = str(spec or "auto").strip()
    if not re.match(DEVICE_PATTERN, spec):
        raise DeviceError(f"{where}: {setting} should be auto, cpu, cuda or cuda:N, got {spec!r}")
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceError(f"{where}: {setting} is {spec} but this machine has no CUDA GPU "
                          f"(torch.cuda.is_available() is False); use auto or cpu")
    dev = torch.device(spec)
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise DeviceError(f"{where}: {setting} is {spec} but this machine has {torch.cuda.device_count()} GPU(s)")
    return dev


def model_device(model: torch.nn.Module) -> torch.device:
    p = next(iter(model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


def autocast(device: torch.device, precision: str = "fp32"):
    """The mixed-precision context of ``precision`` on ``device`` (a no-op for fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision not in PRECISIONS:
        raise ValueError(f"train.precision should be one of {PRECISIONS}, got {precision!r}")
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def grad_scaler(device: torch.device, precision: str):
    """A ``GradScaler`` for fp16 on a GPU; None otherwise."""
    if precision == "fp16" and device.type == "cuda":
        return torch.amp.GradScaler("cuda")
    return None


def backward_step(loss: torch.Tensor, optimizer, scaler=None) -> bool:
    """``zero_grad``, backward and step — through ``scaler`` when there is one. A step whose gradients hold NaN or inf
    is skipped (as a gradient scaler skips it in fp16), so one bad step never turns the model into NaN for good:
    PyTorch's CPU bf16 ``conv3d`` backward gave non-finite weight gradients for 2x2x2 feature maps in some steps of an
    otherwise finite run (SegResNet's deepest level on 16^3 patches; which layers varied from run to run). Returns
    whether the optimizer stepped."""
    optimizer.zero_grad()
    if scaler is not None:
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        return scaler.get_scale() >= before
    loss.backward()
    if not grads_finite([p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]):
        optimizer.zero_grad()
        return False
    optimizer.step()
    return True


def grads_finite(grads: list) -> bool:
    """Whether every gradient is finite: :func:`nonfinite_flag` once per device (one fused check per dtype, not a
    pair of kernels per parameter tensor) and one host read."""
    devices: dict = {}
    for g in grads:
        devices.setdefault(g.device, []).append(g)
    return not any(bool(nonfinite_flag(ts)) for ts in devices.values())


def nonfinite_flag(grads: list) -> torch.Tensor:
    """A 0-dim float32 tensor on the gradients' device (all on one): 1 when any gradient holds NaN or inf, else 0 —
    the gradient scaler's found-inf kernel at scale 1 (which leaves the gradients as they are), once per dtype;
    nothing is read back to the host."""
    dev = grads[0].device
    found, one = torch.zeros((), device=dev), torch.ones((), device=dev)
    groups: dict = {}
    for g in grads:
        groups.setdefault(g.dtype, []).append(g)
    for ts in groups.values():
        torch._amp_foreach_non_finite_check_and_unscale_(ts, found, one)
    return found


def backward_step_on_device(loss: torch.Tensor, optimizer, scaler=None) -> torch.Tensor:
    """:func:`backward_step` without a host read: with a fused optimizer (``fused=True``, :func:`fused_kwargs`) the
    step is skipped *on the device* when a gradient is not finite — the optimizer's own ``found_inf`` input, which
    a gradient scaler uses, also undoes its step count. Returns a 0-dim tensor on the device: 1 for a skipped step.
    Another optimizer, or fp16's gradient scaler, goes through :func:`backward_step` (one host read per step)."""
    fused = bool(optimizer.defaults.get("fused"))
    if scaler is not None or not fused:
        return torch.tensor(float(not backward_step(loss, optimizer, scaler)), device=loss.device)
    optimizer.zero_grad()
    loss.backward()
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    if not grads:
        return torch.zeros((), device=loss.device)
    found = nonfinite_flag(grads)
    optimizer.found_inf = found
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf
    return found


def fused_kwargs(model: torch.nn.Module) -> dict:
    """``{"fused": True}`` for an optimizer of a model on a CUDA GPU (one kernel for all parameters, and a step that
    can be skipped without a host read: :func:`backward_step_on_device`); ``{}`` elsewhere (the CPU keeps its
    optimizer as it was)."""
    return {"fused": True} if model_device(model).type == "cuda" else {}


def uses_channels_last(model: torch.nn.Module) -> bool:
    """Whether :func:`to_channels_last` put ``model`` in channels-last format (its inputs should follow)."""
    return bool(getattr(model, "_fedmed_channels_last", False))


def to_channels_last(model: torch.nn.Module) -> torch.nn.Module:
    """On a CUDA GPU, a 2D convolutional network in channels-last memory format (cuDNN's faster layout for
    convolutions, with tensor cores in mixed precision); elsewhere, and for networks without 2D convolutions,
    unchanged. Its parameters keep their values; what leaves the site (``get_params``) is the same."""
    if model_device(model).type == "cuda" and any(isinstance(m, torch.nn.Conv2d) for m in model.modules()):
        model.to(memory_format=torch.channels_last)
        model._fedmed_channels_last = True
    return model
