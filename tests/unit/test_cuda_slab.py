"""drafter.wire.cuda_slab without a GPU: a shared slab's reference is checked field by field (named
slab.<field>) and must describe exactly the ring's bytes; LocalSlabs round-trips a tensor."""

from __future__ import annotations

import pytest
import torch

from drafter.wire import cuda_slab, schema
from drafter.wire.errors import DrafterError

TOTAL = 4096


def _ref(**kw) -> schema.CudaIpcTensor:
    good = dict(dtype="float32", shape=[TOTAL // 64, 16], stride=[16, 1], storage_offset=0, device_uuid="GPU-1",
                handle=bytes(64), storage_size_bytes=TOTAL, storage_offset_bytes=0,
                ref_counter_handle="/torch_1_2_3", ref_counter_offset=0, event_handle=b"",
                event_sync_required=False, step_event_handle=bytes(64))
    return schema.CudaIpcTensor(**{**good, **kw})


def test_a_good_reference_passes():
    ref = cuda_slab.check_ref(_ref(), "slab", TOTAL)
    assert ref.shape == (TOTAL // 64, 16) and ref.step_event_handle == bytes(64)


@pytest.mark.parametrize("kw,field", [
    (dict(shape=[TOTAL // 64 - 1, 16]), "slab.shape"),  # less than the ring
    (dict(dtype="bfloat16", shape=[TOTAL // 64, 32], stride=[32, 1]), "slab.shape"),
    (dict(handle=bytes(12)), "slab.handle"),
    (dict(ref_counter_handle="/etc/passwd"), "slab.ref_counter_handle"),
    (dict(storage_size_bytes=TOTAL - 64), "slab.storage_size_bytes"),
    (dict(step_event_handle=bytes(7)), "slab.step_event_handle"),
    (dict(device_uuid=""), "slab.device_uuid"),
])
def test_a_bad_reference_is_refused_naming_the_field(kw, field):
    with pytest.raises(DrafterError) as err:
        cuda_slab.check_ref(_ref(**kw), "slab", TOTAL)
    assert err.value.field == field, str(err.value)


def test_no_reference_is_refused():
    with pytest.raises(DrafterError) as err:
        cuda_slab.check_ref(None, "output", TOTAL)
    assert err.value.field == "output"


def test_local_slabs_share_and_open_the_same_memory():
    slabs = cuda_slab.LocalSlabs()
    t = torch.zeros(TOTAL, dtype=torch.uint8)
    ref = cuda_slab.check_ref(slabs.share(t, bytes(64)), "slab", TOTAL)
    opened = slabs.open(ref, torch.device("cpu"), "slab")
    opened[5] = 9
    assert t[5] == 9
