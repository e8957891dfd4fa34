"""Vision-language models on a pack, in float64 against each sequence run alone with its own
images through the model's own forward (``pixel_values``, ``image_grid_thw``): log-probs and
every gradient, the vision tower's included; content keys (same text with different images
never merged, one image in two places encoded once); images in the middle of an agent history;
parts cutting through an image's rows; per-sequence temperatures; bad input refused by name."""

import inspect
import sys

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import treepack  # noqa: E402
from treepack import TreePack, hf, zoo  # noqa: E402
from treepack.adapters.hf import vision  # noqa: E402
from treepack.planning.parts import split  # noqa: E402

from reference import NaiveTrie, naive_gated_delta_rule  # noqa: E402
from tolerance import FLOAT32_RELATIVE, assert_within, inside, scale, within  # noqa: E402

IMAGE = zoo.VISION_IDS["image_token_id"]
A, B, C = ("image", 0), ("image", 1), ("image", 2)
# Sizes: A 4x4 patches (4 tokens), B 4x6 (6), C 6x4 (6).
LAYOUT = [
    [1, 5, A, 7, 8, 9],            # a GRPO group on image A ...
    [1, 5, A, 7, 8, 10, 11],
    [1, 5, A, 7, 12],
    [1, 5, B, 7, 8, 9],            # ... the same text on image B: never merged with A's
    [1, 6, 6, A, 3],               # A again after another context: not merged, encoded once
    [1, 5, A, 7, 20, C, 21, 22],   # an agent history: a screenshot C after a turn ...
    [1, 5, A, 7, 20, C, 21, 23, B, 4],  # ... and the next turn, with B further on
    [1, 5, 9, 9],                  # text only
]


def tiny(family, attn_implementation=None):
    return zoo.tiny_vision_model(family, dtype=torch.float64,
                                 attn_implementation=attn_implementation)


def exact_kernel(monkeypatch, model):
    """The gated-delta-rule kernel in float64 (transformers' casts to float32)."""
    layer = hf.unwrap(model).model.language_model.layers[0]
    module = sys.modules[type(layer).__module__]
    if hasattr(module, "torch_chunk_gated_delta_rule"):
        monkeypatch.setattr(module, "torch_chunk_gated_delta_rule", naive_gated_delta_rule)


def alone(model, batch, s, temperature=1.0):
    """Sequence ``s``'s log-probs, run alone with its images through the model's forward."""
    ids = torch.tensor([batch.sequences[s]])
    mine = len(batch.images[s])
    start = sum(len(x) for x in batch.images[:s])
    kwargs = {}
    if mine and batch.image_grid_thw is None:  # one tensor per image
        kwargs = dict(pixel_values=batch.pixel_values[start:start + mine])
        if "token_type_ids" in inspect.signature(model.forward).parameters:  # Gemma 3: its
            kwargs["token_type_ids"] = (ids == IMAGE).long()  # image tokens, both ways
    elif mine:
        grid = batch.image_grid_thw[start:start + mine]
        rows = batch.image_grid_thw[:start].prod(-1).sum()
        kwargs = dict(pixel_values=batch.pixel_values[rows:rows + grid.prod(-1).sum()],
                      image_grid_thw=grid, mm_token_type_ids=(ids == IMAGE).long())
    logits = model(input_ids=ids, use_cache=False, **kwargs).logits[0].double() / temperature
    return logits[:-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]


def images_of(model, batch, **kwargs):
    return hf.Images(model, batch.sequences, pixel_values=batch.pixel_values,
                     image_grid_thw=batch.image_grid_thw, **kwargs)


def test_llava_images_are_whole_tensors_and_refuse_a_grid():
    model = tiny("llava")
    batch = zoo.image_batch([[1, A, 7], [1, B, 8]], family="llava")
    assert images_of(model, batch).num_images == 2
    with pytest.raises(ValueError, match="take no image_grid_thw"):
        hf.Images(model, batch.sequences, pixel_values=batch.pixel_values,
                  image_grid_thw=torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"\[images, channels, height, width\]"):
        hf.Images(model, batch.sequences, pixel_values=batch.pixel_values.flatten(1))
    with pytest.raises(ValueError, match=r"images of shape \(3, 4, 4\), but llava's vision "
                                         r"tower takes \(3, 8, 8\)"):
        hf.Images(model, batch.sequences, pixel_values=batch.pixel_values[:, :, :4, :4])


def unpacked(model, batch, weights, temperatures):
    model.zero_grad()
    logps = [alone(model, batch, s, float(t)) for s, t in enumerate(temperatures)]
    sum((lp * w).sum() for lp, w in zip(logps, weights)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return [lp.detach() for lp in logps], grads


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


def grad_rel(got, want, name):
    """``rel`` of a gradient; a key bias of a vision tower without rotary positions (llava's
    CLIP, Gemma 3's SigLIP) is zero in exact arithmetic (the softmax ignores a shift of every
    score) and holds only rounding of terms as large as the model's gradients: judged against
    the model's largest, as treepack's bench judges every gradient."""
    w = want[name]
    if "vision_tower" in name and name.endswith("k_proj.bias"):
        return float((got[name] - w).abs().max()) / max(float(v.abs().max()) for v in want.values())
    return rel(got[name], w)


def setup(family, monkeypatch):
    batch = zoo.image_batch(LAYOUT, dtype=torch.float64, family=family)
    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(len(s) - 1, generator=g, dtype=torch.float64) for s in batch.sequences]
    temperatures = torch.linspace(0.7, 1.3, len(LAYOUT), dtype=torch.float64)
    model = tiny(family)
    exact_kernel(monkeypatch, model)
    want_lp, want = unpacked(model, batch, weights, temperatures)
    # transformers computes norms and the vision tower's rotary in float32 even in float64
    # models: log-probs and gradients are float32-accurate there (tolerance.inside)
    grad_tol = inside(model, grads=True)
    return batch, weights, temperatures, model, want_lp, want, grad_tol


def lp_tolerance(model, want_lp):
    """What a float64 model's log-probs may differ by (tolerance.inside of their size)."""
    return inside(model) * max(scale(lp) for lp in want_lp)


def packed(model, batch, weights, temperatures, images=None, pack=None, **kwargs):
    images = images or images_of(model, batch)
    pack = pack or images.pack()
    model.zero_grad()
    out = hf.logprobs(model, pack, images=images, temperature=temperatures, head="logits",
                      **kwargs).logprobs
    got = [out[s, 1:len(seq)] for s, seq in enumerate(batch.sequences)]
    sum((lp * w).sum() for lp, w in zip(got, weights)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return [lp.detach() for lp in got], grads


@pytest.mark.parametrize("family", sorted(zoo.VISION_FAMILIES))
def test_images_on_a_pack_equal_each_sequence_alone(family, monkeypatch):
    batch, weights, temperatures, model, want_lp, want, grad_tol = setup(family, monkeypatch)
    hf.prepare(model)
    images = images_of(model, batch)
    assert images.num_images == 3 and sum(map(len, images.images_of)) == 10
    encoded = []
    tower = vision._visual(hf.unwrap(model))
    handle = tower.register_forward_hook(  # Gemma 3's tower takes pixel_values= by keyword
        lambda m, args, kwargs, out: encoded.append(
            (args[0] if args else kwargs["pixel_values"]).shape[0]), with_kwargs=True)
    got_lp, got = packed(model, batch, weights, temperatures, images)
    handle.remove()
    # one call: each distinct image's patches (or each distinct image) once
    assert encoded == [3 if family in zoo.WHOLE_IMAGES else 16 + 24 + 24]
    lp_tol = lp_tolerance(model, want_lp)
    for s, (a, b) in enumerate(zip(got_lp, want_lp)):
        assert within((a - b).abs().max(), lp_tol), s
    assert set(got) == set(want) and any(n.startswith(("model.visual", "model.vision_tower"))
                                         for n in want)
    for name in want:
        assert within(grad_rel(got, want, name), grad_tol), (name, grad_rel(got, want, name))


def test_gemma3_image_blocks_on_varlen_equal_each_sequence_alone(monkeypatch):
    """Gemma 3's image tokens see each other both ways: on varlen as two calls, the rows
    outside images causally and each image's rows both ways (the kernel's CPU reference)."""
    batch, weights, temperatures, model, want_lp, want, grad_tol = setup("gemma3", monkeypatch)
    hf.prepare(model)
    got_lp, got = packed(model, batch, weights, temperatures, backend="varlen")
    lp_tol = lp_tolerance(model, want_lp)
    for s, (a, b) in enumerate(zip(got_lp, want_lp)):
        assert within((a - b).abs().max(), lp_tol), s
    for name in want:
        assert within(grad_rel(got, want, name), grad_tol), (name, grad_rel(got, want, name))


def test_gemma3_image_blocks_scored_on_flex_equal_segment():
    """Scoring (no gradients: PyTorch has no CPU flex backward) with Gemma 3's image blocks
    on flex, one more mask_mod rule, through the compiled CPU kernel: the log-probs of the
    segment backend, in float32."""
    batch = zoo.image_batch(LAYOUT, dtype=torch.float32, family="gemma3")
    model = tiny("gemma3").float()
    hf.prepare(model)
    images = images_of(model, batch)
    with torch.no_grad():
        got, want = (hf.logprobs(model, images.pack(), images=images, backend=backend).logprobs
                     for backend in ("flex", "segment"))
    assert_within(got, want, FLOAT32_RELATIVE)  # a float32 model, two attention kernels


def test_gemma3_with_images_verifies_in_bfloat16_on_varlen():
    """treepack.verify in bfloat16 (against a float32 reference) with Gemma 3's image blocks
    on varlen: a tensor none of whose elements the gradient settles (a zero-started norm
    weight) is compared on nothing, which crashed the report."""
    from treepack.verification import verification_image_batch

    model = zoo.tiny_vision_model("gemma3", dtype=torch.float32).eval()
    batch = verification_image_batch("gemma3", dtype=torch.float32)
    images = hf.Images(model, batch.sequences, pixel_values=batch.pixel_values)
    report = treepack.verify(model, batch.sequences, backend="varlen", dtype=torch.bfloat16,
                             images=images)
    assert report.passed, report


def test_rows_are_keyed_by_image_content():
    """The pack has the rows of the naive trie over (id, image) pairs: the same text on
    different images forks at the first placeholder, one image in two prompts merges."""
    model = tiny("qwen2_vl")
    batch = zoo.image_batch(LAYOUT)
    images = images_of(model, batch)
    pack = images.pack()
    trie = NaiveTrie([list(zip(seq, key.tolist()))
                      for seq, key in zip(batch.sequences, images.keys)])
    assert pack.num_packed_rows == trie.num_nodes
    first = [r for r, seq in zip(pack.host.rows, batch.sequences)]
    assert first[0][3] == first[1][3] == first[2][3]  # the group's image rows: one
    assert first[0][3] != first[3][3]  # same text, image B: its own rows
    # the same pixels given again (each rollout's copy) are one image
    twice = images_of(model, zoo.image_batch([[1, A, 2], [1, A, 3]]))
    assert twice.num_images == 1 and twice.pack().num_packed_rows == 1 + 6 + 2


def test_parts_cut_through_an_image_and_equal_the_whole_pack(monkeypatch):
    batch, weights, temperatures, model, want_lp, want, grad_tol = setup("qwen3_vl",
                                                                         monkeypatch)
    hf.prepare(model)
    images = images_of(model, batch)
    pack = images.pack()
    cut = 12
    parts = split(pack, cut)
    # some image's placeholder rows are computed by two parts
    feature = np.full(pack.num_rows, -1)
    for rows, f in zip(pack.host.rows, images.features):
        feature[rows[:len(f)]] = f
    image_of = np.searchsorted(images.feature_start, feature, side="right") - 1
    split_images = [u for u in range(images.num_images)
                    if len(np.unique(parts.part_of[(feature >= 0) & (image_of == u)])) > 1]
    assert split_images

    dense = torch.zeros(pack.num_sequences, pack.max_length, dtype=torch.float64)
    for s, w in enumerate(weights):
        dense[s, 1:len(w) + 1] = w
    model.zero_grad()
    result = hf.backward_in_parts(model, parts, lambda out, mask: (out.logprobs * dense).sum(),
                                  temperature=temperatures, images=images)
    lp_tol = lp_tolerance(model, want_lp)
    for s, want_s in enumerate(want_lp):
        got = result.logprobs[s, 1:len(batch.sequences[s])]
        assert within((got - want_s).abs().max(), lp_tol), s
    for name, w in want.items():
        assert within(rel(model.get_parameter(name).grad, w), grad_tol), name


@pytest.mark.parametrize("control", ["keys", "positions", "one_occurrence"])
def test_negative_controls_fail(control, monkeypatch):
    """Each shortcut a VLM pack could take is caught: images keyed by placeholder id alone
    (rows of different images merge), depth positions on an mrope model, and the features of
    an image placed twice with gradients through one place only."""
    batch, weights, temperatures, model, want_lp, want, grad_tol = setup("qwen2_vl",
                                                                         monkeypatch)
    hf.prepare(model)
    images = images_of(model, batch)
    if control == "keys":  # and without the check that the pack's rows agree with them
        images.keys = [np.zeros_like(k) for k in images.keys]
        from treepack.forwards import images as rules  # the rules the adapters share

        monkeypatch.setattr(rules, "_check_rows_agree", lambda *args: None)
    if control == "positions":
        images.positions = None
    if control == "one_occurrence":
        place = vision._place

        def first_only(core, images, feature, where, out, deepstack):
            placed = place(core, images, feature, where, out, deepstack)
            seen = np.unique(feature, return_index=True)[1]
            keep = torch.zeros(out.shape[1], dtype=torch.bool)
            keep[torch.as_tensor(where)] = True
            keep[torch.as_tensor(where[seen])] = False  # the first place of each feature
            return torch.where(keep[None, :, None], placed.detach(), placed)

        monkeypatch.setattr(vision, "_place", first_only)
    got_lp, got = packed(model, batch, weights, temperatures, images)
    lp_err = max(float((a - b).abs().max()) for a, b in zip(got_lp, want_lp))
    grad_err = max(rel(got[n], w) for n, w in want.items())
    assert lp_err > 1e-4 or grad_err > 1e-3


def test_sequences_without_images_on_a_vision_language_model_equal_each_alone():
    model = hf.prepare(tiny("qwen2_vl"))
    batch = zoo.image_batch([[1, 5, 6, 7, 8], [1, 5, 6, 9], [1, 4]])
    out = hf.logprobs(model, TreePack.from_sequences(batch.sequences), head="logits").logprobs
    for s, seq in enumerate(batch.sequences):
        assert_within(out[s, 1:len(seq)], alone(model, batch, s), inside(model))


# ---------------------------------------------------------------------- refusals


def test_placeholders_without_images_are_refused_by_name():
    model = hf.prepare(tiny("qwen2_vl"))
    batch = zoo.image_batch([[1, A, 7], [1, A, 8]])
    with pytest.raises(hf.UnsupportedModel, match=r"ids \[100\] \(its \['image_token_id'\]\)"
                                                  r".*images=treepack.hf.Images"):
        hf.logprobs(model, TreePack.from_sequences(batch.sequences))


@pytest.mark.parametrize("key", ["pixel_values", "image_grid_thw", "mm_token_type_ids"])
def test_image_inputs_as_model_keywords_are_refused_by_name(key):
    model = hf.prepare(tiny("qwen2_vl"))
    pack = TreePack.from_sequences([[1, 5, 6], [1, 5, 7]])
    with pytest.raises(ValueError, match=f"does not take '{key}'.*hf.Images"):
        hf.logprobs(model, pack, **{key: torch.zeros(1)})


def test_bad_images_are_refused_naming_the_sequence():
    model = tiny("qwen2_vl")
    batch = zoo.image_batch([[1, A, 7], [1, B, 8]])
    with pytest.raises(ValueError, match="pixel_values has 39 patch rows but image_grid_thw's "
                                         "2 grids make 40"):
        hf.Images(model, batch.sequences, pixel_values=batch.pixel_values[:-1],
                  image_grid_thw=batch.image_grid_thw)
    short = [batch.sequences[0], batch.sequences[1][:5] + batch.sequences[1][6:]]
    with pytest.raises(ValueError, match="sequence 1: image 1 of the batch needs 6 consecutive"):
        hf.Images(model, short, pixel_values=batch.pixel_values,
                  image_grid_thw=batch.image_grid_thw)
    with pytest.raises(ValueError, match="sequence 1 has 6 image placeholder tokens .* beyond"):
        hf.Images(model, batch.sequences, pixel_values=batch.pixel_values[:16],
                  image_grid_thw=batch.image_grid_thw[:1])
    with pytest.raises(ValueError, match="1 of the 2 images given have no placeholders"):
        hf.Images(model, batch.sequences[:1], pixel_values=batch.pixel_values,
                  image_grid_thw=batch.image_grid_thw)
    with pytest.raises(ValueError, match="sequence 0: num_images says 2"):
        images_of(model, zoo.image_batch([[1, A, 7], [1, B, A, 8]]), num_images=[2, 1])
    with pytest.raises(ValueError, match=r"image_grid_thw\[0\] = \[1, 3, 4\]"):
        hf.Images(model, [[1] + [IMAGE] * 3], pixel_values=torch.zeros(12, 12),
                  image_grid_thw=torch.tensor([[1, 3, 4]]))
    # a 0 in a grid: the value is named, not the shape (which is fine)
    with pytest.raises(ValueError, match=r"image_grid_thw\[1\] = \[1, 0, 4\]: image 1's"):
        hf.Images(model, batch.sequences, pixel_values=batch.pixel_values,
                  image_grid_thw=torch.tensor([[1, 4, 4], [1, 0, 4]]))
    # rows of another model's patches fail here, not inside the vision tower
    with pytest.raises(ValueError, match="rows of 24 values, but qwen2_vl's vision tower takes "
                                         "patches of 12"):
        hf.Images(model, batch.sequences, pixel_values=batch.pixel_values.repeat(1, 2),
                  image_grid_thw=batch.image_grid_thw)


def test_a_pack_built_without_the_image_keys_is_refused():
    model = hf.prepare(tiny("qwen2_vl"))
    batch = zoo.image_batch([[1, A, 7], [1, B, 8]])
    images = images_of(model, batch)
    with pytest.raises(ValueError, match="built without these images' content keys"):
        hf.logprobs(model, TreePack.from_sequences(batch.sequences), images=images)
    with pytest.raises(ValueError, match="images holds 2 sequences but the pack 1"):
        hf.logprobs(model, images.select([0]).pack(), images=images)
    sub = images.select([1])
    out = hf.logprobs(model, sub.pack(), images=sub, head="logits").logprobs
    assert_within(out[0, 1:], alone(model, batch, 1), inside(model))
    images.keys = [np.zeros_like(k) for k in images.keys]  # as if keyed by placeholder id
    with pytest.raises(ValueError, match="rows of the pack hold placeholders of different"):
        hf.logprobs(model, images.pack(), images=images)


def test_images_for_a_text_model_are_refused():
    model = zoo.tiny_model("llama")
    with pytest.raises(hf.UnsupportedModel, match="encodes no images"):
        hf.Images(model, [[1, 2]], pixel_values=torch.zeros(0, 12),
                  image_grid_thw=torch.zeros(0, 3))


def test_gemma3_image_blocks_that_a_tree_cannot_keep_are_refused_by_name():
    """Gemma 3's image tokens see each other both ways: in parts a part's rows would need rows
    a later part computes, and two images with no text between them make one block that a
    fork after the first would split. Both are refused, naming why."""
    model = hf.prepare(tiny("gemma3"))
    batch = zoo.image_batch(LAYOUT, dtype=torch.float64, family="gemma3")
    images = images_of(model, batch)
    with pytest.raises(hf.UnsupportedModel, match="both ways.*in parts"):
        hf.logprobs_in_parts(model, batch.sequences, max_tokens=6, images=images)
    start, end = zoo.VISION_IDS["vision_start_token_id"], zoo.VISION_IDS["vision_end_token_id"]
    adjacent = zoo.image_batch([[1, A, B, 7], [1, A, 8]], dtype=torch.float64, family="gemma3")
    joined = [[t for i, t in enumerate(seq) if not (t == end and seq[i + 1] == start) and
               not (t == start and seq[i - 1] == end)] for seq in adjacent.sequences]
    images = hf.Images(model, joined, pixel_values=adjacent.pixel_values)
    with pytest.raises(hf.UnsupportedModel, match="crosses a fork.*Separate the images"):
        hf.logprobs(model, images.pack(), images=images)


def test_collated_batches_with_images_equal_each_sequence_alone():
    """treepack.collate(keys=images.keys) plans rollouts with images into batches; each batch
    with its share of the images (images.select(batch.pack.seq_ids)) equals each alone."""
    from treepack import collate

    model = hf.prepare(tiny("qwen2_vl"))
    batch = zoo.image_batch(LAYOUT, dtype=torch.float64)
    images = images_of(model, batch)
    rollouts = [{"prompt": seq[:6], "completion": seq[6:]} for seq in batch.sequences]
    step = collate(rollouts, max_tokens=40, keys=images.keys)
    seen = []
    for b in step.batches(0):
        out = hf.logprobs(model, b.pack, images=images.select(b.pack.seq_ids),
                          head="logits").logprobs
        for i, s in enumerate(b.pack.seq_ids.tolist()):
            n = len(batch.sequences[s])
            assert_within(out[i, 1:n], alone(model, batch, s), inside(model))
            seen.append(s)
    assert sorted(seen) == list(range(len(LAYOUT))) and len(step.batches(0)) > 1


def test_images_refuse_adjacent_runs_another_model_and_a_forward_that_embeds_twice():
    model = hf.prepare(tiny("qwen2_vl"))
    batch = zoo.image_batch([[1, A, 7], [1, A, 8]])
    # two images in one run of placeholders: the rope index could not tell them apart
    joined = [1, 102] + [IMAGE] * 8 + [103, 7]
    with pytest.raises(ValueError, match="sequence 0: image 0 of the batch .* is not a whole "
                                         "run of placeholders at position 2"):
        hf.Images(model, [joined], pixel_values=torch.cat([batch.pixel_values[:16]] * 2),
                  image_grid_thw=torch.tensor([[1, 4, 4], [1, 4, 4]]))
    images = images_of(model, batch)
    with pytest.raises(ValueError, match=r"select\(\[2\]...\): these images hold sequences 0 .. 1"):
        images.select([2])
    other = hf.prepare(zoo.tiny_vision_model("qwen3_vl", dtype=torch.float64))
    with pytest.raises(ValueError, match="built for another model"):
        hf.logprobs(other, images.pack(), images=images)
    # a model whose forward embeds the rows twice would encode its images twice
    embed = hf.unwrap(model).get_input_embeddings()

    def embed_again(module, args, kwargs):
        embed(torch.ones(1, 1, dtype=torch.long))

    handle = hf.unwrap(model).model.language_model.register_forward_pre_hook(
        embed_again, with_kwargs=True)
    try:
        with pytest.raises(hf.UnsupportedModel, match="embedded the pack's rows 2 times"):
            hf.logprobs(model, images.pack(), images=images)
    finally:
        handle.remove()


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_placeholder_keys_without_the_model_are_the_images_keys(family):
    """verl's trainer holds a batch's ids and images but not the model: its keys, from the
    placeholder id and each row's images, are those hf.Images builds the packs with (LLaVA's
    adjacent images in one run included)."""
    from treepack.adapters.hf.vision import placeholder_keys

    model = tiny(family)
    batch = zoo.image_batch([[1, A, 7, B], [1, A, B, 8], [3, 4]], family=family)
    images = images_of(model, batch)
    if family == "llava":
        each = [(batch.pixel_values[i:i + 1], None) for i in range(len(batch.pixel_values))]
    else:
        pixels = torch.split(batch.pixel_values, batch.image_grid_thw.prod(-1).tolist())
        each = list(zip(pixels, batch.image_grid_thw))
    per_row = [each[0:2], each[2:4], []]
    got = placeholder_keys(batch.sequences, images.image_token_id, per_row)
    assert all(np.array_equal(a, b) for a, b in zip(got, images.keys))
    with pytest.raises(ValueError, match="sequence 1 has .* for 1 images"):
        placeholder_keys(batch.sequences, images.image_token_id, [each[0:2], each[2:3], []])



V, W = ("video", 0), ("video", 1)  # 2 frames of 4x4 patches (8 tokens), 3 of 4x2 (6)
VIDEO_LAYOUT = [
    [1, 5, V, 7, 20],              # a GRPO group on video V ...
    [1, 5, V, 7, 21, 22],
    [1, 5, W, 7, 20],              # ... the same text on video W: never merged with V's
    [1, A, 6, V, 8, 30],           # an image, then V after another context: encoded once
    [1, 4, 9, W, 3, 31, 32],       # an agent history with a clip mid-way ...
    [1, 4, 9, W, 3, 33],
    [1, 5, 9, 9, 2],               # text only
]


def alone_with_videos(model, batch, s):
    """Sequence ``s``'s log-probs, alone with its own images and videos, taken from the batch
    as the processor laid them out (not from hf.Images' tables)."""
    ids = torch.tensor([batch.sequences[s]])
    kwargs, kinds = {}, (ids == IMAGE).long()
    for name, grids, pixels, mine, first in (
            ("image", batch.image_grid_thw, batch.pixel_values, batch.images,
             lambda i: sum(map(len, batch.images[:i]))),
            ("video", batch.video_grid_thw, batch.pixel_values_videos, batch.videos,
             lambda i: sum(map(len, batch.videos[:i])))):
        if not mine[s]:
            continue
        start = first(s)
        grid = grids[start:start + len(mine[s])]
        rows = int(grids[:start].prod(-1).sum())
        rows = pixels[rows:rows + int(grid.prod(-1).sum())]
        if name == "image":
            kwargs.update(pixel_values=rows, image_grid_thw=grid)
        else:
            kwargs.update(pixel_values_videos=rows, video_grid_thw=grid,
                          second_per_grid_ts=batch.second_per_grid_ts[start:start + len(mine[s])])
            kinds = kinds + 2 * (ids == zoo.VISION_IDS["video_token_id"]).long()
    if "second_per_grid_ts" in kwargs and "second_per_grid_ts" not in inspect.signature(
            model.forward).parameters:
        kwargs.pop("second_per_grid_ts")
    logits = model(input_ids=ids, use_cache=False, mm_token_type_ids=kinds,
                   **kwargs).logits[0].double()
    return logits[:-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_videos_on_a_pack_equal_each_sequence_alone(family, monkeypatch):
    """Videos (Qwen2.5-VL's temporal mrope from its seconds per temporal patch; Qwen3-VL's
    frames as runs with timestamps between) beside images: each distinct video encoded once,
    log-probs and every gradient equal each sequence alone with its own videos."""
    batch = zoo.image_batch(VIDEO_LAYOUT, dtype=torch.float64, family=family)
    model = tiny(family)
    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(len(s) - 1, generator=g, dtype=torch.float64) for s in batch.sequences]
    want_lp = [alone_with_videos(model, batch, s) for s in range(len(batch.sequences))]
    sum((lp * w).sum() for lp, w in zip(want_lp, weights)).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    hf.prepare(model)
    images = hf.Images(model, batch.sequences, pixel_values=batch.pixel_values,
                       image_grid_thw=batch.image_grid_thw,
                       pixel_values_videos=batch.pixel_values_videos,
                       video_grid_thw=batch.video_grid_thw,
                       second_per_grid_ts=batch.second_per_grid_ts)
    assert images.num_images == 3  # A, V and W, however often each appears
    encoded = []
    handle = vision._visual(hf.unwrap(model)).register_forward_hook(
        lambda m, args, out: encoded.append(args[0].shape[0]))
    pack = images.pack()
    out = hf.logprobs(model, pack, images=images).logprobs
    handle.remove()
    assert encoded == [16 + 2 * 16 + 3 * 8]  # each distinct image's and video's patches once
    got = [out[s, 1:len(seq)] for s, seq in enumerate(batch.sequences)]
    lp_tol = lp_tolerance(model, [lp.detach() for lp in want_lp])
    for s, (a, b) in enumerate(zip(got, want_lp)):
        assert within((a.detach() - b.detach()).abs().max(), lp_tol), s
    sum((lp * w).sum() for lp, w in zip(got, weights)).backward()
    for name, w in want.items():  # norms and the tower's rotary compute in float32
        assert within(rel(model.get_parameter(name).grad, w), inside(model, grads=True)), name


# The pack and the stock forward run the same float64 operations in different orders (keys
# gathered per row, reductions over other row sets): they differ by rounding alone, about
# float64's eps (2.2e-16) relative to the largest log-prob (measured: 8.9e-16 at |logp| ~ 5,
# under 1 eps of it). 16 eps of it, ~2e-14, is far below what rounding the pixels to float32
# or bfloat16 costs (1.3e-8 and more).
LOGP_EPS = 16


def logprob_errors(model, batch, **videos):
    """Sequence by sequence, the pack's log-probs against each sequence alone (stock), and the
    float64 allowance: ``LOGP_EPS`` eps relative to the largest log-prob."""
    with torch.no_grad():
        want = [alone_with_videos(model, batch, s) for s in range(len(batch.sequences))]
        hf.prepare(model)
        images = hf.Images(model, batch.sequences, **videos,
                           pixel_values_videos=batch.pixel_values_videos,
                           video_grid_thw=batch.video_grid_thw,
                           second_per_grid_ts=batch.second_per_grid_ts)
        out = hf.logprobs(model, images.pack(), images=images).logprobs
    errors = [float((out[s, 1:len(seq)] - w).abs().max())
              for s, (seq, w) in enumerate(zip(batch.sequences, want))]
    scale = max(float(w.abs().max()) for w in want)
    return errors, LOGP_EPS * torch.finfo(torch.float64).eps * scale


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_float64_videos_without_images_stay_float64(family):
    """Videos and no images: the pixels are the videos' own, in their dtype (never an empty
    float32 image table's, which rounded float64 videos to float32: 1.3e-8 to 3.8e-8 off)."""
    layout = [seq for seq in VIDEO_LAYOUT if A not in seq]
    batch = zoo.image_batch(layout, dtype=torch.float64, family=family)
    model = tiny(family)
    errors, allowed = logprob_errors(model, batch)
    assert max(errors) <= allowed, (errors, allowed)


@pytest.mark.parametrize("family, image_dtype, video_dtype", [
    ("qwen2_vl", torch.bfloat16, torch.float32),  # videos were rounded to bfloat16
    ("qwen3_vl", torch.float32, torch.float64),  # ... and to float32
    ("qwen2_5_vl", torch.float64, torch.float32),  # images were always widened exactly
])
def test_videos_keep_their_dtype_beside_images_of_another(family, image_dtype, video_dtype):
    """Each modality reaches the (float64) vision tower with its own values, as the model's
    get_image_features and get_video_features cast each to the tower's dtype: equal to each
    sequence alone, stock, to float64 rounding."""
    batch = zoo.image_batch(VIDEO_LAYOUT, dtype=torch.float64, family=family)
    batch = batch._replace(pixel_values=batch.pixel_values.to(image_dtype),
                           pixel_values_videos=batch.pixel_values_videos.to(video_dtype))
    model = tiny(family)
    errors, allowed = logprob_errors(model, batch, pixel_values=batch.pixel_values,
                                     image_grid_thw=batch.image_grid_thw)
    assert max(errors) <= allowed, (errors, allowed)


def test_videos_refused_where_they_cannot_run():
    batch = zoo.image_batch([[1, V, 3]], dtype=torch.float64, family="qwen2_5_vl")
    model = hf.prepare(tiny("llava"))
    with pytest.raises(hf.UnsupportedModel, match="runs videos of"):
        hf.Images(model, [[1, 2]], pixel_values=torch.zeros(0, 3, 8, 8),
                  pixel_values_videos=batch.pixel_values_videos,
                  video_grid_thw=batch.video_grid_thw)
    qwen = tiny("qwen2_5_vl")
    with pytest.raises(ValueError, match="second_per_grid_ts has 2 values for 1 videos"):
        hf.Images(qwen, batch.sequences, pixel_values_videos=batch.pixel_values_videos,
                  video_grid_thw=batch.video_grid_thw, second_per_grid_ts=[1.0, 2.0])
    with pytest.raises(ValueError, match="video placeholder tokens.*beyond the 1 videos"):
        hf.Images(qwen, [batch.sequences[0] + batch.sequences[0][1:-1]],
                  pixel_values_videos=batch.pixel_values_videos,
                  video_grid_thw=batch.video_grid_thw)
