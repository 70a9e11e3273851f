"""One exception tree: every DSec exception derives from DsecError, keeps its builtin base, and third-party errors
are translated where they enter (httpx in the client, OSError in the snapshot store)."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import httpx
import pytest

from dsec.client import ApiError, Client, ClientError, Unreachable
from dsec.errors import DsecError, HealingError, InvalidInput, StorageError, TransportError
from dsec.snapshot.store import LocalDirStore, ManifestExists, StoreError

SRC = Path(__file__).resolve().parents[2] / "src" / "dsec"
BUILTIN_EXCEPTIONS = {
    name for name, obj in vars(builtins).items() if isinstance(obj, type) and issubclass(obj, BaseException)
}
# errors.py holds the root itself; fake_nvml.py stands in for pynvml's own exception class, which the code under
# test catches as pynvml's, not as DSec's; recycle.py's MemoryRecycle is no error but a planned stop raised into the
# training code, a BaseException so that a training loop's ``except Exception`` does not swallow it (like SystemExit).
OUTSIDE_THE_TREE = {"errors.py", "scheduler/fake_nvml.py", "probe/recycle.py"}


def test_errors_module_is_the_bottom_layer() -> None:
    tree = ast.parse((SRC / "errors.py").read_text(encoding="utf-8"))
    imported = [
        n.module if isinstance(n, ast.ImportFrom) else a.name
        for n in ast.walk(tree)
        if isinstance(n, (ast.Import, ast.ImportFrom))
        for a in n.names
    ]
    assert not [m for m in imported if m and m.split(".")[0] == "dsec"]


def test_no_exception_class_derives_from_builtins_alone() -> None:
    """A class whose every base is a builtin exception is outside the tree (``class Foo(Exception)``)."""
    outside = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel in OUTSIDE_THE_TREE or rel.startswith("data/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and node.bases:
                names = [b.id if isinstance(b, ast.Name) else ast.unparse(b) for b in node.bases]
                if all(n in BUILTIN_EXCEPTIONS for n in names):
                    outside.append(f"{rel}:{node.lineno} {node.name}({', '.join(names)})")
    assert outside == []


@pytest.mark.parametrize(
    ("qualname", "group", "builtin"),
    [
        ("dsec.model.ModelError", InvalidInput, ValueError),
        ("dsec.yamlconf.ConfigError", InvalidInput, ValueError),
        ("dsec.policy.expr.ExprError", InvalidInput, ValueError),
        ("dsec.probe.chaos.ChaosError", InvalidInput, ValueError),
        ("dsec.alerts.signing.SignatureError", InvalidInput, ValueError),
        ("dsec.control.store.api.StoreUnavailable", StorageError, Exception),
        ("dsec.control.store.api.StoreConflict", StorageError, Exception),
        ("dsec.snapshot.store.StoreError", StorageError, Exception),
        ("dsec.snapshot.store.ManifestExists", StorageError, FileExistsError),
        ("dsec.snapshot.manifest.CorruptSnapshot", StorageError, Exception),
        ("dsec.client.ApiError", TransportError, Exception),
        ("dsec.client.Unreachable", TransportError, Exception),
        ("dsec.alerts.sinks.WebhookError", TransportError, RuntimeError),
        ("dsec.control.egress.EgressRefused", TransportError, Exception),
        ("dsec.heal.membership.Fenced", HealingError, Exception),
        ("dsec.heal.membership.Invalid", HealingError, Exception),
        ("dsec.probe.heal_client.HealUnavailable", HealingError, Exception),
        ("dsec.probe.heal_client.FencedOut", HealingError, Exception),
        ("dsec.probe.heal_ops.NotHealable", HealingError, RuntimeError),
        ("dsec.probe.epoch.Diverged", HealingError, RuntimeError),
        ("dsec.probe.replica_state.TransferError", HealingError, Exception),
        ("dsec.control.errors.ApiError", DsecError, Exception),
        ("dsec.integrations.native.NativeLibraryNotFound", DsecError, FileNotFoundError),
    ],
)
def test_each_exception_sits_in_its_group_and_keeps_its_builtin_base(
    qualname: str, group: type[DsecError], builtin: type[Exception]
) -> None:
    module_name, _, name = qualname.rpartition(".")
    if module_name.startswith(("dsec.probe.heal_ops", "dsec.probe.elastic", "dsec.probe.replica_state")):
        pytest.importorskip("torch")
    module = __import__(module_name, fromlist=[name])
    cls = getattr(module, name)
    assert issubclass(cls, group)
    assert issubclass(cls, builtin)


# -- httpx -> ClientError (dsec.client) ---------------------------------------------------------------
def _client(handler: httpx.MockTransport) -> Client:
    return Client("http://cp.test", token="t", transport=handler)


def test_connection_failure_is_unreachable() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    with _client(httpx.MockTransport(refuse)) as c, pytest.raises(Unreachable) as info:
        c.status()
    assert isinstance(info.value.__cause__, httpx.ConnectError)


def test_undecodable_answer_is_a_client_error_not_unreachable() -> None:
    def garbled(request: httpx.Request) -> httpx.Response:
        raise httpx.DecodingError("bad gzip", request=request)

    with _client(httpx.MockTransport(garbled)) as c, pytest.raises(ClientError) as info:
        c.status()
    assert not isinstance(info.value, Unreachable)
    assert isinstance(info.value.__cause__, httpx.DecodingError)


def test_success_answer_with_broken_json_is_a_client_error() -> None:
    def broken(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"{not json", headers={"content-type": "application/json"})

    with _client(httpx.MockTransport(broken)) as c, pytest.raises(ClientError, match="does not parse"):
        c.status()


def test_error_answer_is_an_api_error() -> None:
    def denied(request: httpx.Request) -> httpx.Response:
        return httpx.Response(403, json={"error": "forbidden", "message": "no"})

    with _client(httpx.MockTransport(denied)) as c, pytest.raises(ApiError) as info:
        c.status()
    assert info.value.status == 403


def test_malformed_endpoint_is_a_client_error() -> None:
    with pytest.raises(ClientError, match="not a URL") as info:
        Client("http://[::bad")
    assert isinstance(info.value.__cause__, httpx.InvalidURL)


# -- OSError -> StoreError (dsec.snapshot.store) ------------------------------------------------------
CHUNK = "ab" + "0" * 62


def test_unreadable_chunk_is_a_store_error_caused_by_the_os_error(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path)
    (tmp_path / "chunks" / "ab" / CHUNK).mkdir(parents=True)  # a directory where the chunk file should be
    with pytest.raises(StoreError) as info:
        store.get_chunk(CHUNK)
    assert isinstance(info.value.__cause__, OSError)


def test_missing_chunk_says_missing(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="missing"):
        LocalDirStore(tmp_path).get_chunk(CHUNK)


def test_failed_chunk_write_is_a_store_error(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path)
    (tmp_path / "chunks" / "ab").write_bytes(b"")  # a file where the chunk's folder should be
    with pytest.raises(StoreError) as info:
        store.put_chunk(CHUNK, b"data")
    assert isinstance(info.value.__cause__, OSError)


def test_taken_manifest_number_is_manifest_exists_and_still_file_exists_error(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path)
    store.put_manifest("w0", 1, b"{}")
    with pytest.raises(ManifestExists) as info:
        store.put_manifest("w0", 1, b"{}")
    assert isinstance(info.value, FileExistsError)
    assert isinstance(info.value, StoreError)


def test_blocked_manifest_folder_is_not_mistaken_for_a_taken_number(tmp_path: Path) -> None:
    # A writer retries the next number on FileExistsError: this one must not look like it, or it loops for ever.
    store = LocalDirStore(tmp_path)
    (tmp_path / "manifests" / "w0").write_bytes(b"")
    with pytest.raises(StoreError) as info:
        store.put_manifest("w0", 1, b"{}")
    assert not isinstance(info.value, FileExistsError)


def test_store_root_that_cannot_be_created_is_a_store_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(StoreError, match="cannot create"):
        LocalDirStore(tmp_path / "file" / "store")


def test_listing_an_unreadable_store_is_a_store_error(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path)
    (tmp_path / "manifests").rmdir()
    (tmp_path / "manifests").write_bytes(b"")
    with pytest.raises(StoreError):
        store.workers()
