"""One filesystem interface for local paths and fsspec URLs (``gs://``, ``s3://``, ``memory://``, ...).

Callers pass any path or URL and never branch on where it lives; the one place that does is
this package (:mod:`.paths` tells a local path from a URL). Plain paths and ``file://`` URLs go
through :mod:`os` (hard links, ``scandir``, ``flock``), everything else through fsspec. Writes
that readers must never see half-done are in :mod:`lm_pipeline.atomic`, which builds on it.

Callers import this package only (``from lm_pipeline import fs``; ``fs.join``, ``fs.staged``):

- :mod:`.paths`: where a path lives and path arithmetic (``is_local``, ``as_local``, ``join``,
  ``parent``, ``resolve``, ``basename``, ``norm``, ``scheme``, ``get_fs``);
- :mod:`.files`: one file or directory (read, ``sha256_of``, ``listdir``, ``file_sizes``, exists,
  makedirs, remove), ``AppendFile``, ``exclusive_lock``;
- :mod:`.trees`: whole directories (download, upload, copy, ``move``, ``put``), ``local_copy``
  and ``staged``;
- :mod:`.remote`: object stores (``url_problem``, ``access_problem(s)``, ``connect_problem``,
  endpoints, ``kvstore_spec``).
"""

from __future__ import annotations

from lm_pipeline.fs.files import (
    AppendFile,
    exclusive_lock,
    exists,
    file_sizes,
    is_local_dir,
    listdir,
    makedirs,
    open_binary,
    read_bytes,
    read_text,
    remove,
    rmtree,
    sha256_of,
)
from lm_pipeline.fs.paths import (
    PathLike,
    as_local,
    basename,
    get_fs,
    is_local,
    join,
    local_path,
    norm,
    parent,
    resolve,
    scheme,
)
from lm_pipeline.fs.remote import (
    CONNECT_TIMEOUT_S,
    access_problem,
    access_problems,
    connect_problem,
    kvstore_spec,
    s3_endpoint,
    url_problem,
)
from lm_pipeline.fs.trees import (
    copy_tree,
    download_tree,
    forget_copy,
    local_copy,
    move,
    put,
    staged,
    upload_tree,
)

__all__ = [
    "CONNECT_TIMEOUT_S",
    "AppendFile",
    "PathLike",
    "access_problem",
    "access_problems",
    "as_local",
    "basename",
    "connect_problem",
    "copy_tree",
    "download_tree",
    "exclusive_lock",
    "exists",
    "file_sizes",
    "forget_copy",
    "get_fs",
    "is_local",
    "is_local_dir",
    "join",
    "kvstore_spec",
    "listdir",
    "local_copy",
    "local_path",
    "makedirs",
    "move",
    "norm",
    "open_binary",
    "parent",
    "put",
    "read_bytes",
    "read_text",
    "remove",
    "resolve",
    "rmtree",
    "s3_endpoint",
    "scheme",
    "sha256_of",
    "staged",
    "upload_tree",
    "url_problem",
]
