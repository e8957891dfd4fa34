"""Routes (the experts each token was routed to) as part of a row: tokens merge only where
their ids, keys, routes and everything before them agree, except each sequence's last token,
whose route is a placeholder. Against a naive token-level trie over (id, key, route)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treepack import TreePack

from strategies import forests

LAYERS, TOPK = 2, 2


def route(*experts):
    """One token's route: ``[LAYERS, TOPK]`` from LAYERS x TOPK expert ids."""
    return np.array(experts, dtype=np.int16).reshape(LAYERS, TOPK)


def naive(seqs, routes, keys):
    """Rows of a token-level trie: every token but the last keyed by (id, key, route); each
    last token then joins a child with its (id, key) if any, else a node of last tokens."""
    children, last_only = [{}], set()

    def walk(i, upto):
        node = 0
        for j in range(upto):
            node = children[node][(seqs[i][j], keys[i][j], routes[i][j].tobytes())]
        return node

    for i, seq in enumerate(seqs):
        node = 0
        for j in range(len(seq) - 1):
            edge = (seq[j], keys[i][j], routes[i][j].tobytes())
            if edge not in children[node]:
                children[node][edge] = len(children)
                children.append({})
            node = children[node][edge]
    count = len(children) - 1
    for i, seq in enumerate(seqs):
        node = walk(i, len(seq) - 1)
        if any(e[:2] == (seq[-1], keys[i][-1]) for e in children[node]):
            continue
        if (node, seq[-1], keys[i][-1]) not in last_only:
            last_only.add((node, seq[-1], keys[i][-1]))
            count += 1
    return count


@st.composite
def routed_forests(draw):
    """Forests whose tokens are routed to one of three routes, one with a layer unrecorded (so
    routes both agree and differ under equal ids, at every depth), with keys on some, and a
    random placeholder last."""
    seqs = draw(forests(vocab=3, max_sequences=6, max_len=8))
    choices = [route(0, 1, 2, 3), route(1, 0, 2, 3), route(-1, -1, 2, 3)]  # -1: unrecorded
    routes = [np.stack([choices[draw(st.integers(0, 2))] for _ in seq]) for seq in seqs]
    for r in routes:
        r[-1] = draw(st.integers(-1, 7))  # the placeholder: anything, as verl pads it
    keys = [draw(st.lists(st.sampled_from([0, 0, 5]), min_size=len(s), max_size=len(s)))
            for s in seqs]
    return seqs, routes, keys


@settings(max_examples=200, deadline=None)
@given(routed_forests(), st.sampled_from(["dense", "flat"]), st.booleans())
def test_rows_merge_where_ids_keys_and_routes_agree(batch, layout, with_keys):
    seqs, routes, keys = batch
    if not with_keys:
        keys = [[0] * len(s) for s in seqs]
    pack = TreePack.from_sequences(seqs, routes=routes, keys=keys if with_keys else None,
                                   layout=layout)
    assert pack.num_packed_rows == naive(seqs, routes, keys)
    h = pack.host
    assert h.row_routes.shape == (pack.num_rows, LAYERS, TOPK)
    assert h.row_routes.dtype == np.int16
    for i, seq in enumerate(seqs):
        rows = (h.rows[h.offsets[i]:h.offsets[i + 1]] if layout == "flat"
                else h.rows[i, :len(seq)])
        assert h.input_ids[rows].tolist() == seq
        # every token but the last replays its own route
        np.testing.assert_array_equal(h.row_routes[rows[:-1]], routes[i][:-1])
        # the last takes a route a longer sequence replays there, else a placeholder's
        others = [routes[k][j] for k in range(len(seqs)) for j in range(len(seqs[k]))
                  if (h.rows[h.offsets[k] + j] if layout == "flat" else h.rows[k, j])
                  == rows[-1]]
        assert any(np.array_equal(h.row_routes[rows[-1]], r) for r in others)


def test_a_prompt_routed_differently_forks_where_its_routes_differ():
    prompt = [1, 2, 3, 4, 5]
    same = np.stack([route(0, 1, 2, 3)] * 6)
    other = same.copy()
    other[2] = route(3, 2, 1, 0)  # the third token went to other experts in this rollout
    pack = TreePack.from_sequences([prompt + [6], prompt + [7], prompt + [8]],
                                   routes=[same, same, other])
    assert pack.num_packed_rows == 5 + 1 + 1 + (6 - 2)  # shared, then forked at token 2
    unrouted = TreePack.from_sequences([prompt + [6], prompt + [7], prompt + [8]])
    assert unrouted.num_packed_rows == 5 + 3 and unrouted.host.row_routes is None


def test_a_last_tokens_placeholder_joins_the_longer_sequences_row():
    """verl's convention: the last token has no route (padded), and must not fork a prompt
    from the rollouts that continue it."""
    r = np.stack([route(0, 1, 2, 3), route(1, 2, 3, 0), route(2, 3, 0, 1)])
    prompt_only = r.copy()
    prompt_only[-1] = 0  # verl's placeholder for the last token
    pack = TreePack.from_sequences([[1, 2, 3], [1, 2, 3, 4]],
                                   routes=[prompt_only, np.concatenate([r, r[:1]])])
    assert pack.num_packed_rows == 4
    np.testing.assert_array_equal(pack.host.row_routes[:3], r)  # the longer one's route


def test_without_sharing_every_token_keeps_its_route_in_input_order():
    r = [np.stack([route(0, 1, 2, 3)] * 3), np.stack([route(1, 0, 3, 2)] * 2)]
    pack = TreePack.from_sequences([[1, 2, 3], [1, 2]], routes=r, share_prefixes=False)
    np.testing.assert_array_equal(pack.host.row_routes, np.concatenate(r))


@pytest.mark.parametrize("routes,words", [
    (np.zeros((2, 3, 2, 2), dtype=np.int64), "routes must be a list"),
    ([np.zeros((3, 2, 2), dtype=np.int64)], "routes has 1 entries for 2 sequences"),
    ([np.zeros((3, 2, 2), dtype=np.int64), np.zeros((3, 2, 2), dtype=np.int64)],
     r"routes\[1\] has shape \(3, 2, 2\) but sequence 1 has 2 tokens"),
    ([np.zeros((3, 2, 2), dtype=np.int64), np.zeros((2, 2, 1), dtype=np.int64)],
     r"routes\[1\] has \[layers, topk\] = \[2, 1\] but routes\[0\] has \[2, 2\]"),
    ([np.zeros((3, 2, 2)), np.zeros((2, 2, 2))], "routes are expert indices"),
    ([np.full((3, 2, 2), -2), np.zeros((2, 2, 2), dtype=np.int64)],
     r"routes\[0\] holds expert index -2 before its last token"),
    ([np.array([[[0, -1], [0, 1]]] * 3), np.zeros((2, 2, 2), dtype=np.int64)],
     r"routes\[0\]\[0, 0\] is \[0, -1\]: a layer's top-k is recorded"),
])
def test_bad_routes_are_refused_naming_the_value_and_the_fix(routes, words):
    with pytest.raises((TypeError, ValueError), match=words):
        TreePack.from_sequences([[1, 2, 3], [1, 2]], routes=routes)


def test_unrecorded_routes_merge_with_each_other_never_with_recorded_ones():
    """-1 throughout a layer's top-k: the router routes the token itself, which on equal
    contexts gives equal routes (verl's replay mask False). Such tokens merge with each
    other; a recorded route, even of the experts the router would pick, is another row."""
    native = np.full((2, 2), -1)
    a = np.stack([native, native, route(0, 1, 2, 3)])
    b = np.stack([native, native, route(1, 0, 3, 2)])
    c = np.stack([route(0, 1, 2, 3), native, native])
    pack = TreePack.from_sequences([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 6]],
                                   routes=[np.concatenate([r, r[:1]]) for r in (a, b, c)])
    # a and b share [1, 2] (unrecorded both) and fork at 3; c forks at its first token
    assert pack.num_packed_rows == 2 + 2 * 2 + 4
    np.testing.assert_array_equal(pack.host.row_routes[0], native)


def test_packs_that_differ_only_in_routes_differ_in_identity():
    """Ranks that must run one pack compare its identity: routes are part of it."""
    from treepack.core.agreement import pack_identity

    r = np.stack([route(0, 1, 2, 3)] * 3)
    other = r.copy()
    other[0] = route(1, 0, 2, 3)
    a, b, c = (TreePack.from_sequences([[1, 2, 3]], routes=[x]) for x in (r, other, r))
    assert pack_identity(a) != pack_identity(b)
    assert pack_identity(a) == pack_identity(c)
