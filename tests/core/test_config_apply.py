"""Writing previewed config edits and undoing them (core/planner/apply.py, backups.py) on real files: numbered
backups that keep the original, undo refused for a file changed since its preview, symlinked configs edited at
their target, backup names never followed, and a full disk (os.write failing with ENOSPC) leaving every config
and every existing backup byte-identical."""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.planner import apply, backups, yamledit
from gpuopt_tui.core.planner.yamledit import ValueEdit

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "yaml"


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "config.yaml"
    shutil.copy(CORPUS / "lightning.yaml", path)
    return path


def write(path: Path, batch: int) -> list[apply.Written]:
    return apply.apply([yamledit.preview(path, [ValueEdit("data_loader.batch_size", batch)])])


def undo(*files: Path) -> list[apply.Restore]:
    restores = apply.undo_preview(files)
    apply.undo(restores)
    return restores


def snapshot(directory: Path) -> dict[str, bytes | str]:
    """Every entry of `directory` (temporary files included): a file's bytes, a symlink's target."""
    return {p.name: os.readlink(p) if p.is_symlink() else p.read_bytes() for p in sorted(directory.iterdir())}


def test_two_applies_then_undo_walks_back_to_the_original_bytes(config: Path) -> None:
    original = config.read_bytes()
    (first,) = write(config, 64)
    after_first = config.read_bytes()
    (second,) = write(config, 32)
    assert (first.backup.name, second.backup.name) == ("config.yaml.backup.1", "config.yaml.backup.2")
    assert first.backup.read_bytes() == original  # the second write kept the first backup
    assert second.backup.read_bytes() == after_first
    assert apply.newest_backups([config]) == [second.backup]

    (restore,) = undo(config)
    assert restore.backup == second.backup and config.read_bytes() == after_first
    assert not second.backup.exists() and first.backup.read_bytes() == original
    undo(config)
    assert config.read_bytes() == original
    assert sorted(p.name for p in config.parent.iterdir()) == ["config.yaml"]
    with pytest.raises(UserError, match="nothing to undo"):
        apply.undo_preview([config])


def test_undo_restores_exactly_the_files_of_the_newest_write(tmp_path: Path) -> None:
    """A and B written together, then A alone: undo puts back A's second write only, then both."""
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    shutil.copy(CORPUS / "lightning.yaml", a)
    shutil.copy(CORPUS / "flow.yaml", b)
    originals = a.read_bytes(), b.read_bytes()
    apply.apply(
        [
            yamledit.preview(a, [ValueEdit("data_loader.batch_size", 64)]),
            yamledit.preview(b, [ValueEdit("data_loader.batch_size", 8)]),
        ]
    )
    together = a.read_bytes(), b.read_bytes()
    apply.apply([yamledit.preview(a, [ValueEdit("data_loader.batch_size", 32)])], [a, b])
    assert [r.path for r in undo(a, b)] == [a]
    assert (a.read_bytes(), b.read_bytes()) == together
    assert [r.path for r in undo(a, b)] == [a, b]
    assert (a.read_bytes(), b.read_bytes()) == originals


def test_undo_is_refused_when_the_file_or_its_backup_changed_since_the_preview(config: Path) -> None:
    write(config, 64)
    restores = apply.undo_preview([config])
    edited = config.read_bytes() + b"# tuned by hand\n"
    config.write_bytes(edited)
    with pytest.raises(UserError, match="changed since the preview; nothing was restored"):
        apply.undo(restores)
    assert config.read_bytes() == edited and restores[0].backup.exists()

    restores = apply.undo_preview([config])
    restores[0].backup.write_bytes(b"seed: 1\n")
    with pytest.raises(UserError, match="backup changed since the preview"):
        apply.undo(restores)
    assert config.read_bytes() == edited


def test_a_symlinked_config_stays_a_link_and_its_target_is_edited(tmp_path: Path) -> None:
    real = tmp_path / "shared" / "base.yaml"
    real.parent.mkdir()
    shutil.copy(CORPUS / "lightning.yaml", real)
    link = tmp_path / "config.yaml"
    link.symlink_to(Path("shared") / "base.yaml")
    original = real.read_bytes()

    (written,) = write(link, 64)
    assert link.is_symlink() and os.readlink(link) == str(Path("shared") / "base.yaml")
    assert written.target == real.resolve() and written.backup == real.resolve().with_name("base.yaml.backup.1")
    assert yamledit.load(link)["data_loader"]["batch_size"] == 64  # the real config holds the new value
    assert written.backup.read_bytes() == original
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "shared"]

    (restore,) = undo(link)
    assert restore.path == link and link.is_symlink() and real.read_bytes() == original


def test_a_backup_name_that_is_a_symlink_is_never_followed(config: Path, tmp_path: Path) -> None:
    victim = tmp_path / "precious.txt"
    victim.write_bytes(b"not yours\n")
    (tmp_path / "config.yaml.backup.1").symlink_to(victim)
    (tmp_path / "config.yaml.backup.2").symlink_to(tmp_path / "nowhere")  # dangling: not followed either
    original = config.read_bytes()

    (written,) = write(config, 64)
    assert written.backup.name == "config.yaml.backup.3" and not written.backup.is_symlink()
    assert written.backup.read_bytes() == original and victim.read_bytes() == b"not yours\n"
    assert apply.newest_backups([config]) == [written.backup]
    undo(config)
    assert config.read_bytes() == original and victim.read_bytes() == b"not yours\n"
    with pytest.raises(UserError, match="nothing to undo"):  # the symlinks are no backups
        apply.undo_preview([config])
    assert (tmp_path / "config.yaml.backup.1").is_symlink()


def test_without_hard_links_backups_are_still_numbered_and_verified(
    config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_links(src: object, dst: object, **kwargs: object) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    original = config.read_bytes()
    assert [w.backup.name for w in write(config, 64)] == ["config.yaml.backup.1"]
    assert [w.backup.name for w in write(config, 32)] == ["config.yaml.backup.2"]
    assert (config.parent / "config.yaml.backup.1").read_bytes() == original
    assert sorted(p.name for p in config.parent.iterdir()) == [
        "config.yaml",
        "config.yaml.backup.1",
        "config.yaml.backup.2",
    ]


def test_an_empty_backup_is_never_restored(config: Path) -> None:
    """A 0-byte backup (an interrupted copy) would empty the config: undo refuses it."""
    write(config, 64)
    (config.parent / "config.yaml.backup.1").write_bytes(b"")
    original = config.read_bytes()
    with pytest.raises(UserError, match=r"config\.yaml\.backup\.1: the backup is empty"):
        apply.undo_preview([config])
    assert config.read_bytes() == original


def full_disk(monkeypatch: pytest.MonkeyPatch, fail_at: int) -> None:
    """os.write fails with ENOSPC from its `fail_at`-th call on (1-based), after writing half of what it was
    given, as a disk that fills up does."""
    real_write = os.write
    calls = 0

    def write(fd: int, data: bytes) -> int:
        nonlocal calls
        calls += 1
        if calls >= fail_at:
            if len(data) > 1:
                real_write(fd, bytes(data[: len(data) // 2]))
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)


def two_files(tmp_path: Path) -> tuple[Path, Path]:
    """Two configs, each with an earlier write's backup."""
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    shutil.copy(CORPUS / "lightning.yaml", a)
    shutil.copy(CORPUS / "flow.yaml", b)
    apply.apply([yamledit.preview(a, [ValueEdit("data_loader.batch_size", 48)])], [a, b])
    apply.apply([yamledit.preview(b, [ValueEdit("data_loader.batch_size", 12)])], [a, b])
    return a, b


# os.write calls of one apply of two files: the two backups, the two files (the rollback comes after)
@pytest.mark.parametrize("fail_at", [1, 2, 3, 4], ids=["backup-a", "backup-b", "file-a", "file-b"])
def test_a_full_disk_while_applying_leaves_every_file_byte_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_at: int
) -> None:
    a, b = two_files(tmp_path)
    patches = [
        yamledit.preview(a, [ValueEdit("data_loader.batch_size", 64)]),
        yamledit.preview(b, [ValueEdit("data_loader.batch_size", 8)]),
    ]
    before = snapshot(tmp_path)
    if fail_at == 4:  # a's rollback must be able to write again: the disk is full for b only
        real_write, calls = os.write, iter(range(1, 100))

        def write_b_fails(fd: int, data: bytes) -> int:
            if next(calls) == 4:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_write(fd, data)

        monkeypatch.setattr(os, "write", write_b_fails)
    else:
        full_disk(monkeypatch, fail_at)
    with pytest.raises(UserError, match="No space left on device") as e:
        apply.apply(patches)
    monkeypatch.undo()
    assert snapshot(tmp_path) == before
    if fail_at == 4:
        assert "the files written before it were put back" in str(e.value)
    assert [r.backup.name for r in apply.undo_preview([a, b])] == ["b.yaml.backup.2"]


def test_a_full_disk_while_undoing_keeps_the_file_and_every_backup(
    config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(config, 64)
    write(config, 32)
    restores = apply.undo_preview([config])
    before = snapshot(config.parent)
    full_disk(monkeypatch, 1)
    with pytest.raises(UserError, match="No space left on device.*every backup is kept"):
        apply.undo(restores)
    monkeypatch.undo()
    assert snapshot(config.parent) == before


@pytest.mark.parametrize("fail", ["fsync", "read back"])
def test_a_backup_that_does_not_read_back_stops_the_write(
    config: Path, monkeypatch: pytest.MonkeyPatch, fail: str
) -> None:
    patch = yamledit.preview(config, [ValueEdit("data_loader.batch_size", 64)])
    before = snapshot(config.parent)
    if fail == "fsync":

        def fsync(fd: int) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "fsync", fsync)
    else:
        real_read: Callable[[Path], bytes] = Path.read_bytes
        monkeypatch.setattr(
            Path, "read_bytes", lambda p: b"" if ".backup." in p.name and p.name.endswith(".tmp") else real_read(p)
        )
    with pytest.raises(UserError, match="cannot write its backup.*nothing was written"):
        apply.apply([patch])
    monkeypatch.undo()
    assert snapshot(config.parent) == before


def test_a_name_taken_by_another_write_moves_the_number_on(config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between choosing a number and linking, another process takes it: the next number is used."""
    real_link = os.link

    def link(src: object, dst: object, **kwargs: object) -> None:
        if str(dst).endswith(".backup.1"):
            Path(str(dst)).write_bytes(b"another process's backup\n")
        real_link(src, dst, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "link", link)
    original = config.read_bytes()
    (written,) = write(config, 64)
    assert written.backup.name == "config.yaml.backup.2"
    assert (config.parent / "config.yaml.backup.1").read_bytes() == b"another process's backup\n"
    assert backups.read_backup(written.backup) == original


def test_a_foreign_ten_digit_neighbour_is_never_restored_nor_removed(config: Path) -> None:
    """A NAME.backup.999999999 the planner did not write makes the next number 1000000000: undo restores the
    planner's own backup, and the foreign file stays."""
    foreign = config.with_name("config.yaml.backup.999999999")
    foreign.write_bytes(b"batch_size: 1\n# not the planner's\n")
    original = config.read_bytes()
    (written,) = write(config, 64)
    assert written.backup.name == "config.yaml.backup.1000000000"
    assert [r.backup for r in undo(config)] == [written.backup]
    assert config.read_bytes() == original and not written.backup.exists()
    assert foreign.read_bytes() == b"batch_size: 1\n# not the planner's\n"


def test_a_users_own_backup_is_never_restored(config: Path) -> None:
    own = config.with_name("config.yaml.backup.5")
    own.write_bytes(b"batch_size: 2\n")
    before = config.read_bytes()
    with pytest.raises(UserError, match="no backups the planner wrote .* nothing to undo"):
        apply.undo_preview([config])
    assert config.read_bytes() == before and own.read_bytes() == b"batch_size: 2\n"


def test_a_backup_changed_since_the_planner_wrote_it_is_refused(config: Path) -> None:
    (written,) = write(config, 64)
    written.backup.write_bytes(b"batch_size: 3\n")
    edited = config.read_bytes()
    with pytest.raises(UserError, match=r"config\.yaml\.backup\.1: changed since the planner wrote it"):
        apply.undo_preview([config])
    assert config.read_bytes() == edited and written.backup.read_bytes() == b"batch_size: 3\n"
