"""SharedStorageConnector faults on hand-made paged caches (harness: test_kv_connector_unit.py):
damaged or foreign folders are skipped at lookup with a warning, a load that fails after the
scheduler counted it reports its blocks, and folders appear atomically even with racing producers."""
from __future__ import annotations

import json
import os
import shutil
import threading

import pytest
import torch

from test_kv_connector_unit import LAYERS, Instance, folder_name, layer_file, prompt, req, true_kv


def _truncate(path):
    with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) - 10)


def _garble_header(path):
    with open(path, "r+b") as fh:
        fh.seek(10)
        fh.write(b"\xff\xfe")


def _edit_meta(folder, edit):
    path = os.path.join(folder, "meta.json")
    meta = json.loads(open(path).read())
    edit(meta)
    open(path, "w").write(json.dumps(meta))


FAULTS = {
    "deleted layer file": lambda d, f: os.remove(f),
    "truncated layer file": lambda d, f: _truncate(f),
    "corrupt header": lambda d, f: _garble_header(f),
    "deleted meta.json": lambda d, f: os.remove(os.path.join(d, "meta.json")),
    "corrupt meta.json": lambda d, f: open(os.path.join(d, "meta.json"), "w").write("{not json"),
    "meta.json lacks keys": lambda d, f: _edit_meta(d, lambda m: m.pop("num_kv_heads")),
    "meta.json path in layer name": lambda d, f: _edit_meta(
        d, lambda m: m["layers"].update({"../escape": {"nbytes": 1, "crc32": 0}})),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_bad_folder_is_skipped_at_lookup_with_warning_and_restored(tmp_path, fault):
    ids = prompt(9)
    Instance(tmp_path).step([req("p", ids)])
    FAULTS[fault](str(tmp_path / folder_name(ids[:8])), layer_file(tmp_path, ids[:8], 1))
    dec = Instance(tmp_path, first_block=20)
    with pytest.warns(RuntimeWarning, match="ignoring stored KV"):
        so, out = dec.step([req("d", ids)])
    assert dec.computed["d"] == 9 and so.num_scheduled_tokens["d"] == 9      # recomputed in full
    torch.testing.assert_close(dec.cache_rows(0, "d", 0, 9), true_kv(0, ids))
    # kv_both: the decode instance stored a good folder in place of the bad one.
    assert [r.is_store for r in so.kv_connector_metadata.requests] == [True]
    assert Instance(tmp_path).sched.get_num_new_matched_tokens(req("e", ids), 0) == (8, False)
    assert [f for f in os.listdir(tmp_path)] == [folder_name(ids[:8])]


@pytest.mark.parametrize("change", ["weights", "head_dim", "dtype"])
def test_folder_from_another_model_is_not_loaded(tmp_path, change):
    ids = prompt(9)
    Instance(tmp_path).step([req("p", ids)])
    kw = {"head_dim": 16} if change == "head_dim" else {}
    dec = Instance(tmp_path, **kw)
    if change == "weights":
        weights = tmp_path.parent / f"{tmp_path.name}-weights"
        weights.mkdir()
        (weights / "model.safetensors").write_bytes(b"other weights")
        dec.cfg.model_path = str(weights)
    if change == "dtype":
        dec.cfg.model_config.dtype = "bfloat16"
    with pytest.warns(RuntimeWarning, match="another model|head_dim|dtype"):
        assert dec.sched.get_num_new_matched_tokens(req("d", ids), 0) == (0, False)


def _flip_data_byte(path):
    with open(path, "r+b") as fh:
        fh.seek(-5, os.SEEK_END)
        b = fh.read(1)
        fh.seek(-5, os.SEEK_END)
        fh.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("layerwise", [False, True])
def test_load_failure_after_lookup_reports_invalid_blocks(tmp_path, layerwise):
    """Bytes flipped inside the data (size and header intact). By default the scheduler's lookup
    reads every byte and refuses the folder; with verify_on_lookup=False only the CRC check at
    load time sees it: the tokens were already counted, so the blocks come back as invalid."""
    ids = prompt(13)
    Instance(tmp_path).step([req("p", ids)])
    _flip_data_byte(layer_file(tmp_path, ids[:12], 1))
    with pytest.warns(RuntimeWarning, match="checksum"):
        assert Instance(tmp_path).sched.get_num_new_matched_tokens(req("d", ids), 0) == (0, False)
    dec = Instance(tmp_path, first_block=20, layerwise=layerwise, verify_on_lookup=False)
    with pytest.warns(RuntimeWarning, match="checksum"):
        so, out = dec.step([req("d", ids)])
    assert dec.sched.get_stats()["num_matched_tokens"] == 12
    assert out.invalid_block_ids == {20, 21, 22} and not out.is_empty()
    assert dec.worker.get_stats()["num_load_errors"] == 1


def test_folder_deleted_between_lookup_and_load(tmp_path):
    ids = prompt(9)
    Instance(tmp_path).step([req("p", ids)])
    dec = Instance(tmp_path, role="kv_consumer", first_block=20)
    r = req("d", ids)
    orig = dec.sched.build_connector_meta

    def build_then_delete(so):
        meta = orig(so)
        shutil.rmtree(tmp_path / folder_name(ids[:8]))
        return meta
    dec.sched.build_connector_meta = build_then_delete
    with pytest.warns(RuntimeWarning, match="recomputed"):
        _, out = dec.step([r])
    assert out.invalid_block_ids == {20, 21}


def test_concurrent_producers_and_reader_never_see_half_a_folder(tmp_path):
    ids = prompt(41)
    n_producers, barrier, errors, seen = 4, threading.Barrier(5), [], []
    final = tmp_path / folder_name(ids[:40])
    stop = threading.Event()

    def produce(k):
        try:
            inst = Instance(tmp_path, role="kv_producer")
            barrier.wait()
            inst.step([req(f"p{k}", ids)])
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    def read():
        barrier.wait()
        while not stop.is_set():
            if final.is_dir():
                files = set(os.listdir(final))
                seen.append(len(files))
                if "meta.json" in files:
                    meta = json.loads((final / "meta.json").read_text())
                    assert set(meta["layers"]) <= {f.removesuffix(".safetensors") for f in files}
    threads = [threading.Thread(target=produce, args=(k,)) for k in range(n_producers)]
    reader = threading.Thread(target=read)
    for t in threads + [reader]:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    reader.join()
    assert not errors
    assert os.listdir(tmp_path) == [final.name]                # no temporary folders left
    assert all(n == len(LAYERS) + 1 for n in seen)            # whole folder or nothing
    assert Instance(tmp_path).sched.get_num_new_matched_tokens(req("d", ids), 0) == (40, False)


def test_commit_replaces_an_invalid_folder(tmp_path):
    ids = prompt(9)
    junk = tmp_path / folder_name(ids[:8])
    junk.mkdir()
    (junk / "garbage.bin").write_bytes(b"x")
    p = Instance(tmp_path)
    with pytest.warns(RuntimeWarning, match="no meta.json"):
        p.step([req("p", ids)])
    assert sorted(os.listdir(junk)) == sorted([f"{n}.safetensors" for n in LAYERS] + ["meta.json"])
    assert p.worker.get_stats()["num_folders_committed"] == 1


def test_failure_inside_forward_leaves_no_folder_and_clears_metadata(tmp_path):
    ids = prompt(9)
    p = Instance(tmp_path)

    def boom(where):
        if where == "after_layer_0":
            raise RuntimeError("forward failed")
    with pytest.raises(RuntimeError):
        p.step([req("p", ids)], hook=boom)
    assert os.listdir(tmp_path) == [] and not p.worker.has_connector_metadata()
