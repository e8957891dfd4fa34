"""TRL's asynchronous GRPO trainer on CPU, without vLLM: the stand-ins its stock tree path
needs there (tests only; the library never uses them).

TRL 1.16's ``AsyncGRPOTrainer`` always loads the model with ``attn_implementation="tree_fa3"``,
whose ``tree_attention`` calls ``flash_attn_varlen_func`` from the Hub's FA3 CUDA kernel;
builds a ``VLLMClient`` on rank 0 (whose ``__init__`` needs ``requests``); and looks up the
GPU's peak FLOPs with ``torch.cuda.get_device_name``. :func:`cpu_stand_ins` replaces the three
while it lasts: a pure-torch ``flash_attn_varlen_func`` (:class:`TorchVarlen`), a client
that fails if used, and no peak FLOPs (no MFU metric).
"""

from __future__ import annotations

import contextlib

import torch


class TorchVarlen:
    """``flash_attn_varlen_func`` in plain torch, with FA's semantics: segment ``s``'s queries
    ``q[cu_q[s]:cu_q[s+1]]`` attend to keys ``k[cu_k[s]:cu_k[s+1]]`` (TRL's ``tree_attention``
    gathers each segment's root-to-segment path there), causal aligned bottom-right; sliding
    window, soft-capping and grouped-query heads. The slow reference: a masked softmax per
    segment."""

    @staticmethod
    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None,
                               causal=True, window_size=(-1, -1), softcap=None, **_):
        out = torch.empty_like(q)
        groups = q.shape[1] // k.shape[1]
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        for s in range(len(cu_q) - 1):
            a, b, c, d = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
            qs = q[a:b].transpose(0, 1)  # [H, Lq, D]
            ks = k[c:d].transpose(0, 1).repeat_interleave(groups, 0)  # [H, Lk, D]
            vs = v[c:d].transpose(0, 1).repeat_interleave(groups, 0)
            i = torch.arange(b - a)[:, None] + (d - c) - (b - a)  # each query's key position
            j = torch.arange(d - c)[None, :]
            allowed = j <= i if causal else torch.ones(b - a, d - c, dtype=torch.bool)
            if window_size[0] >= 0:
                allowed &= j >= i - window_size[0]
            scores = (qs.float() @ ks.float().transpose(-1, -2)) * scale
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            scores = scores.masked_fill(~allowed, float("-inf"))
            out[a:b] = (scores.softmax(-1) @ vs.float()).to(q.dtype).transpose(0, 1)
        return out


class NoVLLMClient:
    """Built by the trainer on rank 0, used only to ask vLLM for ``max_model_len``
    (``token_budget=None``) or to sync a LoRA adapter: neither happens in the tests."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        raise RuntimeError(f"no vLLM server in this run (VLLMClient.{name} called)")


@contextlib.contextmanager
def cpu_stand_ins():
    """While it lasts, TRL's async trainer builds and trains on CPU without vLLM (the module
    doc); then TRL's own functions again."""
    import trl.experimental.async_grpo.async_grpo_trainer as trainer_module
    import trl.experimental.async_grpo.packing as packing

    saved = [(packing, "_flash_attn", lambda: TorchVarlen),
             (trainer_module, "VLLMClient", NoVLLMClient),
             (trainer_module, "get_peak_flops_per_device", lambda accelerator, dtype: None)]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in saved]
    for owner, name, value in saved:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in originals:
            setattr(owner, name, value)
