import pytest
import torch
import torch.distributed

import dist_workers
from launch import spawn
from tolerance import FLOAT32_RELATIVE, assert_within

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch.distributed is not built in")


def test_global_denominators_sum_every_pack_of_every_rank():
    spawn(dist_workers.global_denominators_worker)


def test_parts_average_gradients_in_buckets_as_ddp_would():
    spawn(dist_workers.average_gradients_worker)


def rank_zero_grads_equal(worker, reference, tmp_path):
    """Run ``worker`` on 2 ranks; rank 0's gradients equal ``reference()``'s, to float32
    rounding of the reductions (a float32 model, each gradient relative to its largest)."""
    pytest.importorskip("transformers")
    out = tmp_path / "grads.pt"
    spawn(getattr(dist_workers, worker), str(out))
    got = torch.load(out)
    expect = reference()
    assert got.keys() == expect.keys()
    for k, g in expect.items():
        assert_within(got[k], g, FLOAT32_RELATIVE, msg=k)


@pytest.mark.parametrize("worker", ["ddp_worker", "fsdp_worker"])
def test_one_step_over_a_plan_equals_the_unpacked_batch(worker, tmp_path):
    rank_zero_grads_equal(worker, dist_workers.reference_grads, tmp_path)


@pytest.mark.parametrize("worker", ["ddp_parts_worker", "fsdp_parts_worker",
                                    "fsdp1_parts_worker"])
def test_parts_under_ddp_and_fsdp2_equal_every_sequence_alone(worker, tmp_path):
    """Two ranks, each its own trees run in parts (more than one forward each, different
    counts), under DDP and FSDP2: the averaged gradients equal one process running every
    sequence alone."""
    rank_zero_grads_equal(worker, dist_workers.parts_reference_grads, tmp_path)


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_a_rank_with_an_empty_pack_keeps_the_collectives_in_step(wrapper, tmp_path):
    """A rank with no trees runs a no-op step in parts beside a rank that runs many: nothing
    hangs, and the gradients equal every sequence run alone."""
    pytest.importorskip("transformers")
    out = tmp_path / "grads.pt"
    spawn(dist_workers.empty_rank_parts_worker, str(out), wrapper)
    got, expect = torch.load(out), dist_workers.parts_reference_grads()
    for k, g in expect.items():
        assert_within(got[k], g, FLOAT32_RELATIVE, msg=k)
