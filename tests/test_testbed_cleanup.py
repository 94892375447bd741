"""The CPU test bed cleans what a run leaves behind: vLLM's torch.distributed file stores and verl's
checkpoint-copy locks in the temp dir (they piled up by the hundred over test runs), and nothing else."""

from __future__ import annotations

import tempfile

from verl_tide.testing.testbed import clean_run_files, run_files


def test_what_a_run_left_in_the_temp_dir_goes_and_nothing_else(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # gettempdir() returns it
    (tmp_path / "vllm_dist_old").write_text("")  # before the run: another run's, kept
    before = run_files()
    assert str(tmp_path / "vllm_dist_old") in before
    (tmp_path / "vllm_dist_0123abcd").write_text("")
    (tmp_path / "vllm_dist_dir").mkdir()
    (tmp_path / "vllm_dist_dir" / "x").write_text("")
    (tmp_path / "ckpt_0badf00d.lock").write_text("")
    (tmp_path / "unrelated.lock").write_text("")
    (tmp_path / "ckpt_not_a_lock").write_text("")
    clean_run_files(before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt_not_a_lock", "unrelated.lock", "vllm_dist_old"]
