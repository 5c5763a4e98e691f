"""The build folder is the user's own, and one that cannot be written is named with what to do."""

import os

import pytest

from d2lpar.infra import paths


def test_without_the_variable_the_folder_is_the_users_own(tmp_path, monkeypatch):
    monkeypatch.delenv("D2LPAR_BUILD_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert paths.build_dir("x") == tmp_path / "cache" / "d2lpar" / "x"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert paths.default_root() == tmp_path / "home" / ".cache" / "d2lpar"


def test_the_variable_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("D2LPAR_BUILD_DIR", str(tmp_path / "b"))
    assert paths.build_dir("launch") == tmp_path / "b" / "launch"


@pytest.mark.skipif(os.geteuid() == 0 if hasattr(os, "geteuid") else True,
                    reason="root writes anywhere: a read-only folder cannot be made here")
def test_a_folder_that_cannot_be_written_is_named(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    monkeypatch.setenv("D2LPAR_BUILD_DIR", str(ro))
    with pytest.raises(paths.BuildDirError, match=f"{ro}/x .*set D2LPAR_BUILD_DIR"):
        paths.build_dir("x")


def test_a_file_in_the_way_is_named(tmp_path, monkeypatch):
    (tmp_path / "f").write_text("")
    monkeypatch.setenv("D2LPAR_BUILD_DIR", str(tmp_path / "f"))
    with pytest.raises(paths.BuildDirError, match=r"cannot create .*/f/x \(.*\): set D2LPAR_BUILD_DIR"):
        paths.build_dir("x")
