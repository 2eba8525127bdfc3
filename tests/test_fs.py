"""lm_pipeline.fs helpers on a local path, a ``memory://`` URL and (where behaviour differs on a real
object store: versions, directory markers) moto's S3 server: each helper's result is checked
against what is on disk or in the store, read without the helper."""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid

import fsspec
import pytest
from helpers.s3 import s3_bucket, s3_server  # noqa: F401  (pytest fixtures)

from lm_pipeline import fs


@pytest.fixture
def mem() -> str:
    """A fresh ``memory://`` directory (removed afterwards)."""
    url = f"memory://lmp-fs-{uuid.uuid4().hex[:8]}"
    yield url
    with contextlib.suppress(FileNotFoundError):
        fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)


def _mem_write(url: str, data: bytes) -> None:
    fsspec.filesystem("memory").pipe_file(url.removeprefix("memory://"), data)


def _tree(root: str) -> dict[str, bytes]:
    out = {}
    for parent, _, names in os.walk(root):
        for name in names:
            full = os.path.join(parent, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, root).replace(os.sep, "/")] = f.read()
    return out


# --- naming and path arithmetic -----------------------------------------------------------------


def test_scheme_names_the_protocol_and_nothing_for_plain_paths():
    assert fs.scheme("data/x.jsonl") == ""
    assert fs.scheme("/abs/x") == ""
    assert fs.scheme("file:///abs/x") == "file"
    assert fs.scheme("s3://bucket/key") == "s3"
    assert fs.scheme("memory://root/x") == "memory"
    assert fs.scheme("simplecache::s3://bucket/key") == "s3"


def test_is_local_dir_never_looks_up_urls(tmp_path, mem):
    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_text("x")
    assert fs.is_local_dir(tmp_path / "d")
    assert fs.is_local_dir(f"file://{tmp_path / 'd'}")
    assert not fs.is_local_dir(tmp_path / "f")
    assert not fs.is_local_dir(tmp_path / "missing")
    assert not fs.is_local_dir("gpt2")  # a hub id, not a directory here
    _mem_write(f"{mem}/d/x", b"1")
    assert fs.exists(f"{mem}/d") and not fs.is_local_dir(f"{mem}/d")


def test_parent_of_paths_and_urls(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert fs.parent("a/b.yaml") == os.path.join(os.getcwd(), "a")
    assert fs.parent(f"file://{tmp_path}/a/b") == str(tmp_path / "a")
    assert fs.parent("/") == "/"
    assert fs.parent("s3://bucket/a/b.yaml") == "s3://bucket/a"
    assert fs.parent("s3://bucket/a/") == "s3://bucket"
    assert fs.parent("s3://bucket") == "s3://bucket"
    assert fs.parent("memory://root/x") == "memory://root"


def test_resolve_joins_relative_refs_and_keeps_urls_and_absolute_paths(tmp_path):
    assert fs.resolve(tmp_path / "conf", "data.yaml") == str(tmp_path / "conf" / "data.yaml")
    assert fs.resolve(tmp_path / "conf", "../data.yaml") == os.path.join(tmp_path, "conf", "../data.yaml")
    assert fs.resolve(tmp_path / "conf", "/etc/x.yaml") == "/etc/x.yaml"
    assert fs.resolve("s3://b/conf", "data.yaml") == "s3://b/conf/data.yaml"
    assert fs.resolve("s3://b/conf", "gs://c/data.yaml") == "gs://c/data.yaml"
    assert fs.resolve(tmp_path, "memory://r/data.yaml") == "memory://r/data.yaml"


# --- reading --------------------------------------------------------------------------------------


def test_read_bytes_missing_is_none_or_an_error_naming_the_file(tmp_path, mem):
    (tmp_path / "x").write_bytes(b"local")
    _mem_write(f"{mem}/x", b"remote")
    for base, content in ((str(tmp_path), b"local"), (mem, b"remote")):
        assert fs.read_bytes(fs.join(base, "x"), missing_ok=False) == content
        assert fs.read_bytes(fs.join(base, "nope")) is None
        with pytest.raises(FileNotFoundError, match="nope"):
            fs.read_bytes(fs.join(base, "nope"), missing_ok=False)


def test_sha256_of_local_and_remote_files(tmp_path, mem):
    data = os.urandom((1 << 20) + 12345)  # more than one read block
    (tmp_path / "big").write_bytes(data)
    _mem_write(f"{mem}/big", data)
    want = hashlib.sha256(data).hexdigest()
    assert fs.sha256_of(tmp_path / "big") == want
    assert fs.sha256_of(f"file://{tmp_path}/big") == want
    assert fs.sha256_of(f"{mem}/big") == want
    with pytest.raises(FileNotFoundError):
        fs.sha256_of(f"{mem}/nope")


def test_file_sizes_lists_every_file_with_its_size(tmp_path, mem):
    files = {"a.txt": b"1", "sub/b.bin": b"22", "sub/deep/c": b"333"}
    for rel, data in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)
        _mem_write(f"{mem}/{rel}", data)
    (tmp_path / "empty").mkdir()  # a directory is not a file
    want = {rel: len(data) for rel, data in sorted(files.items())}
    assert fs.file_sizes(tmp_path) == want
    assert list(fs.file_sizes(tmp_path)) == sorted(want)
    assert fs.file_sizes(mem) == want
    assert fs.file_sizes(tmp_path / "missing") == {} and fs.file_sizes(f"{mem}/missing") == {}


# --- local copies ----------------------------------------------------------------------------------


def test_local_copy_of_a_local_path_is_the_path_itself(tmp_path):
    (tmp_path / "x").write_bytes(b"x")
    cache = tmp_path / "cache"
    called = []
    assert fs.local_copy(tmp_path / "x", cache_dir=str(cache), key=lambda: called.append(1) or "k") == str(tmp_path / "x")
    assert fs.local_copy(f"file://{tmp_path}/x", cache_dir=str(cache)) == str(tmp_path / "x")
    assert not cache.exists() and not called  # nothing copied, the key never computed
    fs.forget_copy(tmp_path / "x", cache_dir=str(cache))
    assert (tmp_path / "x").read_bytes() == b"x"  # forgetting never touches the path itself


def test_local_copy_of_a_url_is_downloaded_once_and_again_when_rewritten(tmp_path, mem, monkeypatch):
    cache = str(tmp_path / "cache")
    _mem_write(f"{mem}/f.json", b"v1")
    first = fs.local_copy(f"{mem}/f.json", cache_dir=cache)
    assert first.startswith(cache) and open(first, "rb").read() == b"v1"
    downloads = []
    real_get = fsspec.filesystem("memory").get_file
    monkeypatch.setattr(type(fsspec.filesystem("memory")), "get_file",
                        lambda self, *a, **k: downloads.append(a) or real_get(*a, **k))
    assert fs.local_copy(f"{mem}/f.json", cache_dir=cache) == first and downloads == []  # reused
    _mem_write(f"{mem}/f.json", b"version two")  # rewritten: another size, another copy
    second = fs.local_copy(f"{mem}/f.json", cache_dir=cache)
    assert second != first and open(second, "rb").read() == b"version two" and len(downloads) == 1
    assert sorted(os.listdir(cache)) == sorted([os.path.basename(first), os.path.basename(second)])  # no temp left
    fs.forget_copy(f"{mem}/f.json", cache_dir=cache)
    assert not os.path.exists(second) and os.path.exists(first)
    with pytest.raises(FileNotFoundError):
        fs.local_copy(f"{mem}/nope", cache_dir=cache)


def test_local_copy_of_a_directory_url_and_an_explicit_key(tmp_path, mem):
    cache = str(tmp_path / "cache")
    _mem_write(f"{mem}/d/a", b"A")
    _mem_write(f"{mem}/d/s/b", b"B")
    copy = fs.local_copy(f"{mem}/d", cache_dir=cache, key=lambda: "mine")
    assert copy == os.path.join(cache, "mine") and _tree(copy) == {"a": b"A", "s/b": b"B"}
    fs.forget_copy(f"{mem}/d", cache_dir=cache, key="mine")
    assert not os.path.exists(copy)


def test_local_copy_on_s3_follows_the_objects_version(tmp_path, s3_bucket):  # noqa: F811 (fixtures)
    cache = str(tmp_path / "cache")
    url = s3_bucket.url("dir", "f.txt")
    fs.put(_write(tmp_path / "v1", b"same"), url)
    first = fs.local_copy(url, cache_dir=cache)
    assert open(first, "rb").read() == b"same" and fs.local_copy(url, cache_dir=cache) == first
    fs.put(_write(tmp_path / "v2", b"SAME"), url)  # same size, new content: a new ETag
    second = fs.local_copy(url, cache_dir=cache)
    assert second != first and open(second, "rb").read() == b"SAME"
    tree = fs.local_copy(s3_bucket.url("dir"), cache_dir=cache)
    assert _tree(tree) == {"f.txt": b"SAME"}


def _write(path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


# --- staged writes -----------------------------------------------------------------------------------


def test_staged_local_target_is_written_in_place(tmp_path):
    target = tmp_path / "out"
    with fs.staged(target, last=("marker",), clear=True) as local:
        assert local == str(target) and not target.exists()  # no staging copy, nothing made
        os.makedirs(local)
        (target / "a").write_bytes(b"a")
    assert _tree(target) == {"a": b"a"}
    with fs.staged(f"file://{target}") as local:
        assert local == str(target)


def test_staged_url_is_uploaded_on_exit_with_the_marker_last(tmp_path, mem, monkeypatch):
    target = f"{mem}/out"
    order = []
    real_put = fs.put
    monkeypatch.setattr(fs.trees, "put", lambda src, dst: order.append(fs.basename(dst)) or real_put(src, dst))
    with fs.staged(target, last=("marker",)) as local:
        assert os.path.isdir(local) and not fs.exists(target)  # a real local directory, not yet published
        for name in ("marker", "a", "b"):
            with open(os.path.join(local, name), "w") as f:
                f.write(name)
        os.makedirs(os.path.join(local, "sub"))
        with open(os.path.join(local, "sub", "z"), "w") as f:
            f.write("z")
    assert not os.path.exists(local)  # the staging directory is gone
    assert fs.file_sizes(target) == {"a": 1, "b": 1, "marker": 6, "sub/z": 1}
    assert fs.read_bytes(f"{target}/sub/z") == b"z"
    assert order[-1] == "marker" and sorted(order) == ["a", "b", "marker", "z"]


def test_staged_url_uploads_nothing_after_an_exception(mem):
    with pytest.raises(RuntimeError), fs.staged(f"{mem}/out") as local:
        with open(os.path.join(local, "a"), "w") as f:
            f.write("a")
        raise RuntimeError("writer failed")
    assert not fs.exists(f"{mem}/out/a") and not os.path.exists(local)


def test_staged_clear_removes_an_earlier_upload_marker_first(mem, monkeypatch):
    target = f"{mem}/out"
    for name in ("marker", "stale", "a"):
        _mem_write(f"{target}/{name}", b"old")
    removed = []
    real_remove, real_rmtree = fs.remove, fs.rmtree
    monkeypatch.setattr(fs.trees, "remove", lambda p: removed.append(("remove", fs.basename(p))) or real_remove(p))
    monkeypatch.setattr(fs.trees, "rmtree", lambda p: removed.append(("rmtree", fs.basename(p))) or real_rmtree(p))
    with fs.staged(target, last=("marker",), clear=True) as local:
        for name in ("marker", "a"):
            with open(os.path.join(local, name), "w") as f:
                f.write("new")
    assert removed[:2] == [("remove", "marker"), ("rmtree", "out")]
    assert fs.file_sizes(target) == {"a": 3, "marker": 3}  # the stale file is gone


def test_staged_upload_to_s3(tmp_path, s3_bucket):  # noqa: F811 (fixtures)
    target = s3_bucket.url("artifacts", "x")
    with fs.staged(target, last=("manifest.json",)) as local:
        with open(os.path.join(local, "manifest.json"), "w") as f:
            f.write("{}")
        os.makedirs(os.path.join(local, "d"))
        with open(os.path.join(local, "d", "w.bin"), "wb") as f:
            f.write(b"\0" * 10)
    assert fs.file_sizes(target) == {"d/w.bin": 10, "manifest.json": 2}
    assert fs.read_bytes(f"{target}/d/w.bin") == b"\0" * 10


# --- moving -------------------------------------------------------------------------------------------


def test_move_local_is_a_rename(tmp_path):
    (tmp_path / "src" / "s").mkdir(parents=True)
    (tmp_path / "src" / "s" / "f").write_bytes(b"f")
    inode = os.stat(tmp_path / "src" / "s" / "f").st_ino
    fs.move(tmp_path / "src", tmp_path / "aside" / "dst", first=("s",))
    assert not (tmp_path / "src").exists()
    assert os.stat(tmp_path / "aside" / "dst" / "s" / "f").st_ino == inode  # not copied


def test_move_on_an_object_store_deletes_the_marker_first(mem, monkeypatch):
    for name in ("marker", "a", "sub/b"):
        _mem_write(f"{mem}/src/{name}", name.encode())
    real_rmtree = fs.rmtree

    def killed(path):  # the process dies after the marker is deleted, before the rest
        raise KeyboardInterrupt

    monkeypatch.setattr(fs.trees, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        fs.move(f"{mem}/src", f"{mem}/dst", first=("marker",))
    assert fs.file_sizes(f"{mem}/src") == {"a": 1, "sub/b": 5}  # no longer complete
    assert fs.file_sizes(f"{mem}/dst") == {"a": 1, "marker": 6, "sub/b": 5}
    monkeypatch.setattr(fs.trees, "rmtree", real_rmtree)
    fs.rmtree(f"{mem}/dst")
    _mem_write(f"{mem}/src/marker", b"marker")
    fs.move(f"{mem}/src", f"{mem}/dst", first=("marker",))
    assert fs.file_sizes(f"{mem}/src") == {} and fs.read_bytes(f"{mem}/dst/sub/b") == b"sub/b"


# --- access checks ---------------------------------------------------------------------------------


def test_access_problems_lists_each_bucket_once_and_names_each_url(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(fs.remote, "access_problem", lambda url: calls.append(url) or f"{url}: the bucket is missing")
    urls = ["s3://b/x", "s3://b/y/z", str(tmp_path), "file:///tmp/a", "s3://c/w", "nosuch://b/q"]
    problems = fs.access_problems(urls)
    assert calls == ["s3://b", "s3://c"]  # one listing per bucket, none for local paths
    assert problems["s3://b/x"] == "s3://b/x: the bucket is missing"
    assert problems["s3://b/y/z"] == "s3://b/y/z: the bucket is missing"
    assert "unknown URL scheme 'nosuch'" in problems["nosuch://b/q"]
    assert set(problems) == {"s3://b/x", "s3://b/y/z", "s3://c/w", "nosuch://b/q"}


def test_access_problems_on_s3(s3_bucket):  # noqa: F811 (fixtures)
    good = s3_bucket.url("store")
    missing = "s3://lm-no-such-bucket-" + uuid.uuid4().hex[:8] + "/store"
    problems = fs.access_problems([good, missing, f"{missing}/more"])
    assert set(problems) == {missing, f"{missing}/more"} and "does not exist" in problems[missing]


# --- appending -----------------------------------------------------------------------------------------


def test_append_file_local_file(tmp_path, mem):
    local = fs.AppendFile(tmp_path / "log.txt")
    assert local.local_file == str(tmp_path / "log.txt")
    local.close()
    _mem_write(f"{mem}/log.txt", b"before\n")
    remote = fs.AppendFile(f"{mem}/log.txt")
    staging = remote.local_file
    assert os.path.isfile(staging) and open(staging).read() == "before\n"
    with open(staging, "a") as f:  # what a writer holding the file name writes
        f.write("after\n")
    remote.close()
    assert fs.read_text(f"{mem}/log.txt") == "before\nafter\n" and not os.path.exists(staging)
