"""References that cannot share treepack's bugs: a token-at-a-time dict trie.

No sorting, no LCP, no intervals: every prefix is a dict path, ancestors are parent walks.
"""

from __future__ import annotations

import math
import sys


class NaiveTrie:
    """Token-level trie over the sequences; node 0 is a virtual root."""

    def __init__(self, sequences):
        self.children = [{}]
        self.parent = [-1]
        self.depth = [-1]
        self.token = [-1]
        self.ends = [0]  # how many sequences end at the node
        self.paths = []  # per sequence: the trie node of each token
        for seq in sequences:
            node, path = 0, []
            for tok in seq:
                tok = tuple(map(int, tok)) if isinstance(tok, tuple) else int(tok)
                nxt = self.children[node].get(tok)
                if nxt is None:
                    nxt = len(self.parent)
                    self.children[node][tok] = nxt
                    self.children.append({})
                    self.parent.append(node)
                    self.depth.append(self.depth[node] + 1)
                    self.token.append(tok)
                    self.ends.append(0)
                node = nxt
                path.append(node)
            self.ends[node] += 1
            self.paths.append(path)

    @property
    def num_nodes(self) -> int:
        """Distinct non-empty prefixes."""
        return len(self.parent) - 1

    def ancestors_or_self(self, node: int) -> set[int]:
        out = set()
        while node > 0:
            out.add(node)
            node = self.parent[node]
        return out

    def starts_segment(self, node: int) -> bool:
        """Compressed-node boundary: a root, a child of a branch point or of a sequence end."""
        par = self.parent[node]
        return par == 0 or len(self.children[par]) > 1 or self.ends[par] > 0


def naive_token_logprobs(logits, sequences, rows):
    """Per-occurrence reference, one log-softmax per occurrence (nothing shared)."""
    import torch

    n, L = len(sequences), max(len(s) for s in sequences)
    out = torch.zeros(n, L, dtype=torch.float64)
    for s, seq in enumerate(sequences):
        for p in range(1, len(seq)):
            row = logits[int(rows[s][p - 1])].double()
            out[s, p] = row[int(seq[p])] - torch.logsumexp(row, 0)
    return out


def naive_entropy(row) -> float:
    """Entropy of softmax(row) in plain Python floats."""
    m = max(row)
    w = [math.exp(x - m) for x in row]
    z = sum(w)
    return -sum(wi / z * math.log(wi / z) for wi in w if wi > 0)


def naive_gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None,
                           output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
    """The gated delta rule one token at a time, in the inputs' dtype (float64 stays float64):
    S <- S * exp(g); S <- S + k (beta (v - S^T k))^T; out = S^T q / sqrt(Dk). Shapes as
    transformers' kernels: q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], g, beta [B, T, Hv]; or g
    [B, T, Hv, Dk], a gate per key channel (Kimi Delta Attention)."""
    import torch

    repeat = value.shape[2] // key.shape[2]
    q, k = query.repeat_interleave(repeat, 2), key.repeat_interleave(repeat, 2)
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * q.shape[-1] ** -0.5
    B, T, H, Dk = k.shape
    state = (torch.zeros(B, H, Dk, value.shape[-1], dtype=value.dtype)
             if initial_state is None else initial_state)
    out = []
    for t in range(T):
        decay = g[:, t].exp()
        state = state * (decay[..., None, None] if decay.dim() == 2 else decay[..., None])
        memory = (state * k[:, t, ..., None]).sum(-2)  # [B, H, Dv]
        delta = (value[:, t] - memory) * beta[:, t, ..., None]
        state = state + k[:, t, ..., None] * delta[..., None, :]
        out.append((state * q[:, t, ..., None]).sum(-2))
    return torch.stack(out, 1), (state if output_final_state else None)


def block_tables(bm):
    """(partial, full) key-side and (partial, full) query-side tables as dense [nb, nb]."""
    import torch

    nb = bm.kv_indices.shape[-1]

    def dense(num, idx):  # row i lists its first num[i] block columns in idx[i]
        num, idx = num[0, 0], idx[0, 0]
        listed = torch.arange(idx.shape[-1]) < num[:, None]
        rows = torch.arange(len(num))[:, None].expand_as(idx)
        out = torch.zeros(len(num), nb, dtype=torch.bool)
        out[rows[listed], idx[listed].long()] = True
        return out

    return (dense(bm.kv_num_blocks, bm.kv_indices), dense(bm.full_kv_num_blocks, bm.full_kv_indices),
            dense(bm.q_num_blocks, bm.q_indices), dense(bm.full_q_num_blocks, bm.full_q_indices))


def exact_kernel(monkeypatch, model):
    """The model's gated-delta-rule kernel in its own dtype (transformers' casts to float32),
    so float64 runs compare exactly."""
    module = sys.modules[type(model).__module__]
    for name in ("torch_chunk_gated_delta_rule", "chunk_kimi_delta_attention"):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, naive_gated_delta_rule)


# whatever asks for float32 gets float64 while it lasts: the library's, which treepack bench
# --e2e runs its float64 runs under
from treepack.face.benchmark import precision  # noqa: E402

float64_throughout = precision.float64_throughout


def naive_ssd(x, dt, A, B, C, D=None, initial_state=None):
    """Mamba2's SSD one token at a time, in the inputs' dtype: h <- exp(dt A) h + dt x B^T
    (h ``[b, heads, P, N]``, mamba_ssm's layout), y = h C + D x. ``x`` ``[b, L, heads, P]``,
    ``dt`` ``[b, L, heads]`` (after bias and softplus), ``A`` ``[heads]``, ``B``, ``C``
    ``[b, L, groups, N]`` (head h reads group h // (heads / groups)), ``D`` ``[heads]`` or
    ``[heads, P]``. Returns (y, final state)."""
    import torch

    b, length, heads, P = x.shape
    repeat = heads // B.shape[2]
    B, C = B.repeat_interleave(repeat, 2), C.repeat_interleave(repeat, 2)
    h = (torch.zeros(b, heads, P, B.shape[-1], dtype=x.dtype) if initial_state is None
         else initial_state)
    out = []
    for t in range(length):
        h = h * (dt[:, t] * A).exp()[..., None, None] \
            + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        out.append((h * C[:, t, :, None, :]).sum(-1))
    y = torch.stack(out, 1)
    if D is not None:
        y = y + x * (D[:, None] if D.dim() == 1 else D)
    return y, h
