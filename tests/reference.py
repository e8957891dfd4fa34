"""References that cannot share treepack's bugs: a token-at-a-time dict trie.

No sorting, no LCP, no intervals: every prefix is a dict path, ancestors are parent walks.
"""

from __future__ import annotations

import math


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
                tok = int(tok)
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
