"""Checkpoints: atomic save, manifest verification, newest-valid selection, keep-last pruning."""

import json

from plait.checkpoint import Saver, latest_valid, list_checkpoints, verify


def _save(saver, step, payload=b"x" * 1000):
    return saver.save(step, lambda d: (d / "model.pt").write_bytes(payload), {"format": 1})


def test_save_verify_and_prune(tmp_path):
    saver = Saver(tmp_path, keep_last=2)
    for step in (10, 20, 30):
        _save(saver, step)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [30, 20]
    assert verify(tmp_path / "step_00000030") is None
    manifest = json.loads((tmp_path / "step_00000030" / "manifest.json").read_text())
    assert manifest["files"]["model.pt"]["bytes"] == 1000 and manifest["step"] == 30
    assert not list(tmp_path.glob(".tmp-*"))


def test_truncated_and_altered_are_detected_and_skipped(tmp_path):
    saver = Saver(tmp_path, keep_last=5)
    for step in (10, 20, 30):
        _save(saver, step)
    f30 = tmp_path / "step_00000030" / "model.pt"
    f30.write_bytes(f30.read_bytes()[:500])  # truncated
    f20 = tmp_path / "step_00000020" / "model.pt"
    f20.write_bytes(b"y" * 1000)  # altered, same size
    assert "truncated" in verify(tmp_path / "step_00000030")
    assert "checksum" in verify(tmp_path / "step_00000020")
    msgs = []
    assert latest_valid(tmp_path, log=msgs.append) == tmp_path / "step_00000010"
    assert len(msgs) == 2 and all("\n" not in m and "skipped" in m for m in msgs)


def test_a_renamed_checkpoint_is_not_taken_for_a_newer_one(tmp_path):
    """The newest is found by the folder's name: step_25 holding step 15 was resumed as the newest
    (and the steps after 20 redone)."""
    saver = Saver(tmp_path, keep_last=5)
    for step in (15, 20):
        _save(saver, step)
    (tmp_path / "step_00000015").rename(tmp_path / "step_00000025")
    msgs = []
    assert latest_valid(tmp_path, log=msgs.append) == tmp_path / "step_00000020"
    assert msgs == [f"checkpoint {tmp_path / 'step_00000025'} skipped: its folder is named for step 25 but it "
                    "holds step 15 (renamed?)"]


def test_a_damaged_newer_checkpoint_does_not_count_as_kept(tmp_path):
    """Resuming past a damaged step 30 with keep_last 1 and saving step 25: step 25 is kept (the
    damaged one counted as the one kept, and the step resumed from and the new save were deleted)."""
    saver = Saver(tmp_path, keep_last=5)
    for step in (10, 20, 30):
        _save(saver, step)
    f30 = tmp_path / "step_00000030" / "model.pt"
    f30.write_bytes(b"y" * 1000)  # altered, same size: only its checksum tells
    assert latest_valid(tmp_path, log=lambda m: None) == tmp_path / "step_00000020"  # the resume
    Saver(tmp_path, keep_last=1).save(25, lambda d: (d / "model.pt").write_bytes(b"z" * 1000), {"format": 1})
    assert [s for s, _ in list_checkpoints(tmp_path)] == [30, 25]  # the damaged one stays, reported
    assert latest_valid(tmp_path, log=lambda m: None) == tmp_path / "step_00000025"
    # training reaches step 30 again: the new save is the one kept, the damaged one set aside
    Saver(tmp_path, keep_last=1).save(30, lambda d: (d / "model.pt").write_bytes(b"w" * 1000), {"format": 1})
    assert [s for s, _ in list_checkpoints(tmp_path)] == [30] and verify(tmp_path / "step_00000030") is None


def test_a_hand_edited_manifest_is_damage_not_a_traceback(tmp_path):
    saver = Saver(tmp_path, keep_last=5)
    _save(saver, 10)
    folder = tmp_path / "step_00000010"
    good = json.loads((folder / "manifest.json").read_text())
    for files in ({}, [], {"model.pt": {"sha256": "0" * 64}}, None):  # none listed, a list, no size, null
        (folder / "manifest.json").write_text(json.dumps(dict(good, files=files)))
        assert verify(folder) is not None
    (folder / "manifest.json").write_text("[]")
    assert verify(folder) == "manifest.json unreadable"


def test_unfinished_save_is_not_a_checkpoint(tmp_path):
    (tmp_path / ".tmp-step_00000040").mkdir()
    (tmp_path / "step_00000050").mkdir()  # no manifest: a crash between mkdir and manifest
    assert "manifest.json missing" in verify(tmp_path / "step_00000050")
    assert latest_valid(tmp_path, log=lambda m: None) is None


def test_resaving_a_step_keeps_the_old_folder(tmp_path):
    saver = Saver(tmp_path, keep_last=5)
    _save(saver, 10, b"a" * 10)
    _save(saver, 10, b"b" * 10)
    assert (tmp_path / "step_00000010" / "model.pt").read_bytes() == b"b" * 10
    assert len(list(tmp_path.glob("step_00000010.replaced-*"))) == 1
    # the set-aside save goes once keep_last no longer keeps step 10
    for step in (20, 30, 40, 50):
        _save(saver, step, b"c" * 10)
    assert len(list(tmp_path.glob("step_00000010.replaced-*"))) == 1  # step 10 still kept (5 of 5)
    _save(saver, 60, b"c" * 10)
    assert not list(tmp_path.glob("step_00000010*"))


def test_only_the_files_the_manifest_lists_are_read(tmp_path):
    """A file dropped beside a sharded checkpoint's files (a model.pt nobody saved) is not loaded in
    their place: its bytes were never checksummed."""
    import json

    from plait.parallel.sharded_state import state_files

    shard = tmp_path / "model.shard000-of-001.pt"
    shard.write_bytes(b"x")
    (tmp_path / "model.pt").write_bytes(b"stray")
    (tmp_path / "manifest.json").write_text(json.dumps({"files": {shard.name: {"bytes": 1, "sha256": ""}}}))
    assert state_files(tmp_path, "model") == [shard]
    (tmp_path / "manifest.json").unlink()  # a folder without a manifest: what is there
    assert state_files(tmp_path, "model") == [tmp_path / "model.pt"]


def test_a_save_missing_a_part_its_manifest_no_longer_lists_is_skipped(tmp_path):
    """A manifest edited down with its file (train_state.json, rng.pt, one optimizer shard) passed
    every checksum: the resume crashed reading train_state.json, or refused the run as "not a
    plait checkpoint" where the intact save before it could go on."""
    saver = Saver(tmp_path, keep_last=5)
    files = ("train_state.json", "rng.pt", "model.shard000-of-002.pt", "model.shard001-of-002.pt",
             "optim.shard000-of-002.pt", "optim.shard001-of-002.pt")
    for step in (10, 20):
        saver.save(step, lambda d: [(d / f).write_bytes(b"x") for f in files], {"format": 2})
    assert verify(tmp_path / "step_00000020") is None
    for gone, says in (("optim.shard001-of-002.pt", "its optim files are incomplete"),
                       ("rng.pt", "rng.pt is not in it"), ("train_state.json", "train_state.json is not in it")):
        folder = tmp_path / "step_00000020"
        doc = json.loads((folder / "manifest.json").read_text())
        del doc["files"][gone]
        (folder / "manifest.json").write_text(json.dumps(doc))
        (folder / gone).unlink()
        msgs = []
        assert latest_valid(tmp_path, log=msgs.append) == tmp_path / "step_00000010"
        assert len(msgs) == 1 and says in msgs[0], msgs
