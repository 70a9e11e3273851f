"""SQLAlchemy implementation of the store (SQLite by default, PostgreSQL via DSEC_DATABASE_URL)."""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import orjson
from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, Engine, Table, create_engine, delete, event, func, insert, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError, OperationalError, SQLAlchemyError

import dsec.control.store.tables as t
from dsec.control.store.api import (
    EventQuery,
    HotRow,
    PlacementRow,
    PolicyRow,
    RuntimeRow,
    StoreConflict,
    StoreError,
    StoreUnavailable,
    TokenRow,
    WorkerRow,
    WriteBatch,
)
from dsec.fsutil import private_dir, private_file
from dsec.model import Device, Directive, DirectiveFields, Event, EventType, Pool

_MIGRATIONS = Path(__file__).with_name("migrations")


def json_dumps(value: Any) -> str:
    """JSON columns' text: orjson instead of SQLAlchemy's default ``json.dumps``. The writer serializes every dirty
    worker row's info and metrics on each flush; ``json.dumps`` was a sixth of its time at 10,000 workers, holding the
    GIL the event loop needs. The same JSON values (non-string keys as strings, tuples as arrays), except that a
    non-finite float is written as null where ``json.dumps`` wrote ``NaN``/``Infinity``, which is not JSON (the
    API never accepts one; reading such a value back could not be served either). Read back with ``json.loads``,
    which also reads what ``json.dumps`` wrote before."""
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()


#: SQLite has ``UPDATE ... FROM`` (3.33+) and JSON functions built in (3.38+), which the one-statement forms of
#: ``SqlStore._write_hot`` and ``SqlStore._insert_events`` need; an older SQLite takes the per-row forms.
_SQLITE_ONE_STATEMENT = sqlite3.sqlite_version_info >= (3, 38, 0)

#: ``SqlStore._write_hot``: each element of the JSON array parameter is [last_beat_at, last_seq, acked_version, beats,
#: metrics, id]. Rows whose worker is gone match nothing (an UPDATE: a late copy cannot bring a worker back).
_HOT_SQLITE = (
    "UPDATE workers SET last_beat_at = json_extract(j.value, '$[0]'), last_seq = json_extract(j.value, '$[1]'), "
    "acked_version = json_extract(j.value, '$[2]'), beats = json_extract(j.value, '$[3]'), "
    "metrics = json_extract(j.value, '$[4]') FROM json_each(?) AS j WHERE workers.id = json_extract(j.value, '$[5]')"
)
#: ``SqlStore._insert_events`` on SQLite: each element is [ts, type, worker_id, pool, data], inserted in array order.
_EVENTS_SQLITE = (
    "INSERT INTO events (ts, type, worker_id, pool, data) SELECT json_extract(j.value, '$[0]'), "
    "json_extract(j.value, '$[1]'), json_extract(j.value, '$[2]'), json_extract(j.value, '$[3]'), "
    "json_extract(j.value, '$[4]') FROM json_each(?) AS j ORDER BY j.key"
)
#: The largest id ``events`` ever handed out (AUTOINCREMENT keeps it in sqlite_sequence; the table's own largest id
#: where no sequence row exists yet).
_EVENTS_LARGEST_ID = (
    "SELECT max(coalesce((SELECT seq FROM sqlite_sequence WHERE name = 'events'), 0), "
    "coalesce((SELECT max(id) FROM events), 0))"
)
#: SQLite's largest rowid: an AUTOINCREMENT table that reaches it fails the insert (SQLITE_FULL); left to RETURNING.
_MAX_ROWID = 2**63 - 1
_HOT_POSTGRES = (
    "UPDATE workers AS w SET last_beat_at = (x.v->>0)::float8, last_seq = (x.v->>1)::bigint, "
    "acked_version = (x.v->>2)::integer, beats = (x.v->>3)::bigint, metrics = x.v->4 "
    "FROM json_array_elements(%s::json) AS x(v) WHERE w.id = x.v->>5"
)


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    # WAL: readers (API queries) never block the single writer thread and vice versa.
    cur.execute("PRAGMA journal_mode=WAL")
    # FULL: a committed transaction survives power loss, not only a process crash. Group commit
    # amortises the extra fsync over every heartbeat in the batch.
    cur.execute("PRAGMA synchronous=FULL")
    cur.execute("PRAGMA busy_timeout=5000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def _private_sqlite(db: Path) -> None:
    """The database and its -wal/-shm files hold token hashes and runtime secrets: 0600 from the first byte.

    SQLite creates -wal and -shm with the database file's permissions, so creating the (empty) database file 0600
    before SQLite opens it is enough; no process-wide umask change (which would race other threads creating files).
    Files left wider by an older version are narrowed."""
    private_dir(db.parent)
    private_file(db)
    for suffix in ("-wal", "-shm", "-journal"):
        side = db.with_name(db.name + suffix)
        if side.exists():
            private_file(side)


class SqlStore:
    """Store over any SQLAlchemy URL. Thread-safe: each call checks a connection out of the pool."""

    def __init__(self, url: str) -> None:
        self.url = url
        try:
            if url.startswith("sqlite"):
                path = url.split("///", 1)[-1]
                if path and path != ":memory:":
                    _private_sqlite(Path(path))
                self._engine: Engine = create_engine(
                    url, connect_args={"check_same_thread": False}, json_serializer=json_dumps
                )
                event.listen(self._engine, "connect", _sqlite_pragmas)
            else:
                self._engine = create_engine(url, pool_pre_ping=True, json_serializer=json_dumps)
        except (SQLAlchemyError, ImportError, OSError) as exc:
            raise StoreUnavailable(f"cannot open database {self._redacted()}: {exc}") from exc
        self._upserts: dict[tuple[str, str], Any] = {}  # (table, key) -> statement (_upsert_statement)

    def _redacted(self) -> str:
        return (
            self._engine.url.render_as_string(hide_password=True)
            if hasattr(self, "_engine")
            else (self.url.split("@")[-1])
        )

    # -- lifecycle -------------------------------------------------------------------------
    def migrate(self) -> None:
        """Bring the schema to the newest Alembic revision (idempotent)."""
        cfg = Config()
        cfg.set_main_option("script_location", str(_MIGRATIONS))
        try:
            with self._engine.begin() as conn:
                cfg.attributes["connection"] = conn
                command.upgrade(cfg, "head")
        except (SQLAlchemyError, OSError) as exc:
            raise StoreUnavailable(f"cannot migrate {self._redacted()}: {exc}") from exc
        if self._engine.dialect.name == "sqlite":
            path = self._engine.url.database
            if path and path != ":memory:" and os.path.exists(path):
                _private_sqlite(Path(path))

    def close(self) -> None:
        self._engine.dispose()

    # -- helpers ---------------------------------------------------------------------------
    def _upsert(self, conn: Connection, table: Table, rows: Sequence[Mapping[str, Any]], key: str) -> None:
        if not rows:
            return
        stmt = self._upserts.get((table.name, key))
        if stmt is None:
            stmt = self._upserts[(table.name, key)] = self._upsert_statement(table, key)
        if stmt is not False:
            conn.execute(stmt, list(rows))
        else:  # portable fallback: delete + insert inside the caller's transaction
            conn.execute(delete(table).where(table.c[key].in_([r[key] for r in rows])))
            conn.execute(insert(table), list(rows))

    def _upsert_statement(self, table: Table, key: str) -> Any:
        """INSERT ... ON CONFLICT (key) DO UPDATE of every other column, built once per table (``_upserts``): building
        it — the ``excluded`` alias and its column proxies — was a fifth of the writer thread's time at 10,000
        workers (py-spy), on every transaction. False where the dialect has no such statement."""
        dialect = self._engine.dialect.name
        if dialect not in ("sqlite", "postgresql"):
            return False
        stmt = (sqlite if dialect == "sqlite" else postgresql).insert(table)
        update_cols = [c.name for c in table.columns if c.name != key]
        return stmt.on_conflict_do_update(index_elements=[key], set_={c: stmt.excluded[c] for c in update_cols})

    def _write_hot(self, conn: Connection, rows: Sequence[HotRow]) -> None:
        """The beat-only columns of existing rows, in one statement: the rows go as one JSON array parameter that
        the database unpacks (``_HOT_SQLITE``, ``_HOT_POSTGRES``).

        Why one statement and not an executemany: the driver gives the GIL up around every row's step and must take
        it back after, and beside a thread that computes (the event loop under load, the periodic judgments) each
        taking back can wait out the interpreter's switch interval. Measured on this 2-core machine (4,000 rows of a
        real ``workers`` table in parts of 1,000, SQLite, one other thread computing): executemany 8 ms alone but
        ~4.9 s beside it (0.74 s at a 0.5 ms switch interval); one statement 17 ms alone, 68 ms beside it (25 ms).
        The unpacking runs inside the database without the GIL. Floats keep their value: the JSON numbers are
        Python's shortest round-trip form, which SQLite and PostgreSQL parse back to the same double; the metrics
        are written as the JSON text serialized here (``json_dumps``'s, as every JSON column), unchanged.

        An SQLite older than 3.38 and other dialects take the executemany."""
        if not rows:
            return
        dialect = conn.dialect.name
        if dialect == "postgresql" or (dialect == "sqlite" and _SQLITE_ONE_STATEMENT):
            packed = json_dumps(
                [(r.last_beat_at, r.last_seq, r.acked_version, r.beats, dict(r.metrics.items()), r.id) for r in rows]
            )
            conn.exec_driver_sql(_HOT_POSTGRES if dialect == "postgresql" else _HOT_SQLITE, (packed,))
            return
        mark = "?" if conn.dialect.paramstyle == "qmark" else "%s"
        sql = (
            f"UPDATE workers SET last_beat_at = {mark}, last_seq = {mark}, acked_version = {mark}, beats = {mark}, "
            f"metrics = {mark} WHERE id = {mark}"
        )
        params = [
            (r.last_beat_at, r.last_seq, r.acked_version, r.beats, json_dumps(dict(r.metrics.items())), r.id)
            for r in rows
        ]
        conn.exec_driver_sql(sql, params)

    def _run(self, what: str, fn: Any) -> Any:
        try:
            return fn()
        except IntegrityError as exc:
            raise StoreConflict(f"{what}: {exc.orig}") from exc
        except OperationalError as exc:
            raise StoreUnavailable(f"{what}: {exc.orig}") from exc
        except SQLAlchemyError as exc:
            raise StoreError(f"{what}: {exc}") from exc

    # -- pools and devices -----------------------------------------------------------------
    def put_pool(self, pool: Pool, now: float) -> None:
        def go() -> None:
            with self._engine.begin() as conn:
                self._upsert(conn, t.pools, [{"name": pool.name, "spec": pool.to_dict(), "updated_at": now}], "name")

        self._run("put_pool", go)

    def delete_pool(self, name: str) -> bool:
        def go() -> bool:
            with self._engine.begin() as conn:
                # A pool re-created under the same name must not accept the old pool's tokens.
                conn.execute(delete(t.tokens).where(t.tokens.c.pool == name))
                return conn.execute(delete(t.pools).where(t.pools.c.name == name)).rowcount > 0

        return bool(self._run("delete_pool", go))

    def list_pools(self) -> list[Pool]:
        def go() -> list[Pool]:
            with self._engine.connect() as conn:
                rows = conn.execute(select(t.pools.c.spec).order_by(t.pools.c.name)).all()
            return [Pool.from_dict(r.spec) for r in rows]

        return list(self._run("list_pools", go))

    def put_devices(self, devices: Iterable[Device], now: float) -> None:
        rows = [{"id": d.id, "spec": d.to_dict(), "updated_at": now} for d in devices]

        def go() -> None:
            with self._engine.begin() as conn:
                self._upsert(conn, t.devices, rows, "id")

        self._run("put_devices", go)

    def list_devices(self) -> list[Device]:
        def go() -> list[Device]:
            with self._engine.connect() as conn:
                rows = conn.execute(select(t.devices.c.spec).order_by(t.devices.c.id)).all()
            return [Device.from_dict(r.spec) for r in rows]

        return list(self._run("list_devices", go))

    # -- the batched write path ------------------------------------------------------------
    def write(self, batch: WriteBatch) -> list[int]:
        def go() -> list[int]:
            with self._engine.begin() as conn:
                self._write_state(conn, batch)
                ids = self._insert_events(conn, batch.events)
                self._write_deletions(conn, batch)
            return ids

        return list(self._run("write", go))

    def _write_state(self, conn: Connection, batch: WriteBatch) -> None:
        """The batch's upserts (and policy versions, inserted: an existing version is a conflict)."""
        self._upsert(conn, t.workers, [_worker_to_row(w) for w in batch.workers], "id")
        self._write_hot(conn, batch.hot)
        directive_rows = [
            {"worker_id": d.worker_id, "version": d.version, "fields": d.fields.to_dict(), "updated_at": d.updated_at}
            for d in batch.directives
        ]
        self._upsert(conn, t.directives, directive_rows, "worker_id")
        pool_rows = [{"name": p.name, "spec": p.to_dict(), "updated_at": at} for p, at in batch.pools]
        self._upsert(conn, t.pools, pool_rows, "name")
        self._upsert(conn, t.devices, [{"id": d.id, "spec": d.to_dict(), "updated_at": at} for d, at in batch.devices],
                     "id")  # fmt: skip
        placement_rows = [
            {"job": p.job, "pool": p.pool, "placement": dict(p.placement), "placed_at": p.placed_at}
            for p in batch.placements
        ]
        self._upsert(conn, t.placements, placement_rows, "job")
        if batch.policies:
            conn.execute(insert(t.policy_versions), [asdict(p) for p in batch.policies])

    @staticmethod
    def _insert_events(conn: Connection, events: Sequence[Event]) -> list[int]:
        if not events:
            return []
        if conn.dialect.name == "sqlite" and _SQLITE_ONE_STATEMENT:
            ids = _insert_events_sqlite(conn, events)
            if ids is not None:
                return ids
        # One executemany INSERT ... RETURNING, ids in parameter order on every backend (SQLAlchemy's
        # "insertmanyvalues").
        rows = [
            {"ts": ev.ts, "type": ev.type.value, "worker_id": ev.worker_id, "pool": ev.pool, "data": dict(ev.data)}
            for ev in events
        ]
        res = conn.execute(insert(t.events).returning(t.events.c.id, sort_by_parameter_order=True), rows)
        return [int(i) for i in res.scalars()]

    @staticmethod
    def _write_deletions(conn: Connection, batch: WriteBatch) -> None:
        if batch.deleted_workers:
            gone = list(batch.deleted_workers)
            conn.execute(delete(t.directives).where(t.directives.c.worker_id.in_(gone)))
            conn.execute(delete(t.workers).where(t.workers.c.id.in_(gone)))
        if batch.deleted_pools:
            # A pool re-created under the same name must not accept the old pool's tokens.
            conn.execute(delete(t.tokens).where(t.tokens.c.pool.in_(batch.deleted_pools)))
            conn.execute(delete(t.pools).where(t.pools.c.name.in_(batch.deleted_pools)))
        if batch.released_placements:
            conn.execute(delete(t.placements).where(t.placements.c.job.in_(batch.released_placements)))

    def list_workers(self) -> list[WorkerRow]:
        def go() -> list[WorkerRow]:
            with self._engine.connect() as conn:
                rows = conn.execute(select(t.workers).order_by(t.workers.c.id)).mappings().all()
            return [_row_to_worker(r) for r in rows]

        return list(self._run("list_workers", go))

    def list_directives(self) -> list[Directive]:
        def go() -> list[Directive]:
            with self._engine.connect() as conn:
                rows = conn.execute(select(t.directives)).all()
            return [
                Directive(
                    worker_id=r.worker_id,
                    version=r.version,
                    fields=DirectiveFields.from_dict(r.fields),
                    updated_at=r.updated_at,
                )
                for r in rows
            ]

        return list(self._run("list_directives", go))

    def prune_events(self, before: float, keep: Sequence[EventType] = ()) -> int:
        stmt = delete(t.events).where(t.events.c.ts < before)
        if keep:
            stmt = stmt.where(t.events.c.type.not_in([k.value for k in keep]))

        def go() -> int:
            with self._engine.begin() as conn:
                return int(conn.execute(stmt).rowcount)

        return int(self._run("prune_events", go))

    def query_events(self, query: EventQuery) -> list[Event]:
        ev = t.events
        stmt = select(ev).where(ev.c.id > query.after_id)
        if query.worker_id is not None:
            stmt = stmt.where(ev.c.worker_id == query.worker_id)
        if query.pool is not None:
            stmt = stmt.where(ev.c.pool == query.pool)
        if query.types:
            stmt = stmt.where(ev.c.type.in_([ty.value for ty in query.types]))
        if query.since is not None:
            stmt = stmt.where(ev.c.ts >= query.since)
        if query.until is not None:
            stmt = stmt.where(ev.c.ts < query.until)
        stmt = stmt.order_by(ev.c.id).limit(query.limit)

        def go() -> list[Event]:
            with self._engine.connect() as conn:
                rows = conn.execute(stmt).all()
            return [
                Event(id=r.id, ts=r.ts, type=EventType(r.type), worker_id=r.worker_id, pool=r.pool, data=r.data)
                for r in rows
            ]

        return list(self._run("query_events", go))

    def count_events(self) -> int:
        def go() -> int:
            with self._engine.connect() as conn:
                return int(conn.execute(select(func.count()).select_from(t.events)).scalar_one())

        return int(self._run("count_events", go))

    # -- tokens ----------------------------------------------------------------------------
    def put_token(self, token: TokenRow) -> None:
        def go() -> None:
            with self._engine.begin() as conn:
                conn.execute(
                    insert(t.tokens),
                    {
                        "token_hash": token.token_hash,
                        "pool": token.pool,
                        "kind": token.kind,
                        "label": token.label,
                        "created_at": token.created_at,
                    },
                )

        self._run("put_token", go)

    def list_tokens(self) -> list[TokenRow]:
        def go() -> list[TokenRow]:
            with self._engine.connect() as conn:
                rows = conn.execute(select(t.tokens)).all()
            return [TokenRow(r.token_hash, r.pool, r.kind, r.label, r.created_at) for r in rows]

        return list(self._run("list_tokens", go))

    def delete_token(self, token_hash: str) -> bool:
        def go() -> bool:
            with self._engine.begin() as conn:
                return conn.execute(delete(t.tokens).where(t.tokens.c.token_hash == token_hash)).rowcount > 0

        return bool(self._run("delete_token", go))

    # -- runtimes --------------------------------------------------------------------------
    def put_runtime(self, runtime: RuntimeRow) -> None:
        row = {
            "id": runtime.id,
            "name": runtime.name,
            "type": runtime.type,
            "callback_url": runtime.callback_url,
            "secret": runtime.secret,
            "token_hash": runtime.token_hash,
            "pool": runtime.pool,
            "registered_at": runtime.registered_at,
            "report": dict(runtime.report),
            "reported_at": runtime.reported_at,
        }

        def go() -> None:
            with self._engine.begin() as conn:
                self._upsert(conn, t.runtimes, [row], "id")

        self._run("put_runtime", go)

    def list_runtimes(self) -> list[RuntimeRow]:
        def go() -> list[RuntimeRow]:
            with self._engine.connect() as conn:
                rows = conn.execute(select(t.runtimes).order_by(t.runtimes.c.id)).mappings().all()
            return [RuntimeRow(**dict(r)) for r in rows]

        return list(self._run("list_runtimes", go))

    def delete_runtime(self, runtime_id: str) -> bool:
        def go() -> bool:
            with self._engine.begin() as conn:
                return conn.execute(delete(t.runtimes).where(t.runtimes.c.id == runtime_id)).rowcount > 0

        return bool(self._run("delete_runtime", go))

    # -- placements and policies (written in batches, with their events) ---------------------
    def list_placements(self) -> list[PlacementRow]:
        def go() -> list[PlacementRow]:
            with self._engine.connect() as conn:
                rows = conn.execute(select(t.placements).order_by(t.placements.c.job)).mappings().all()
            return [PlacementRow(**dict(r)) for r in rows]

        return list(self._run("list_placements", go))

    def current_policy(self) -> PolicyRow | None:
        def go() -> PolicyRow | None:
            stmt = select(t.policy_versions).order_by(t.policy_versions.c.version.desc()).limit(1)
            with self._engine.connect() as conn:
                row = conn.execute(stmt).mappings().first()
            return None if row is None else PolicyRow(**dict(row))

        result: PolicyRow | None = self._run("current_policy", go)
        return result


def _insert_events_sqlite(conn: Connection, events: Sequence[Event]) -> list[int] | None:
    """The events in one INSERT ... SELECT over a JSON array, and their ids without RETURNING (None, inserting
    nothing, where the ids would come near SQLite's largest rowid: the caller uses RETURNING).

    RETURNING hands each id back with a step of its own, and the driver gives the GIL up around each step: under
    load (the event loop computing beside this thread) every taking back can wait out a switch interval, so a
    commit of a few events took tens of ms (``SqlStore._write_hot`` says more). Here: one step for the largest id
    handed out so far, one for the insert.

    ``events.id`` is AUTOINCREMENT (migration 0005): every new id is above every id the table ever handed out
    (``before``), and the rows of one INSERT get increasing ids in the order the SELECT gives them. So n new ids,
    all above ``before`` and the last ``before + n``, can only be ``before + 1 .. before + n`` — what SQLite does
    (the largest + 1 for each row). Any other last id (a trigger inserting rows of its own, say) fails the
    transaction rather than answer ids that may be wrong."""
    before = int(conn.exec_driver_sql(_EVENTS_LARGEST_ID).scalar() or 0)
    n = len(events)
    if before + n >= _MAX_ROWID:
        return None
    packed = json_dumps([(e.ts, e.type.value, e.worker_id, e.pool, dict(e.data)) for e in events])
    last = conn.exec_driver_sql(_EVENTS_SQLITE, (packed,)).lastrowid
    if last != before + n:
        raise StoreError(f"insert events: {n} events after id {before} should end at id {before + n}, not {last}")
    return list(range(before + 1, last + 1))


def _worker_to_row(w: WorkerRow) -> dict[str, Any]:
    return {
        "id": w.id,
        "pool": w.pool,
        "info": dict(w.info),
        "state": w.state,
        "token_hash": w.token_hash,
        "registered_at": w.registered_at,
        "last_beat_at": w.last_beat_at,
        "last_seq": w.last_seq,
        "acked_version": w.acked_version,
        "beats": w.beats,
        "metrics": dict(w.metrics),
    }


def _row_to_worker(r: Any) -> WorkerRow:
    return WorkerRow(
        id=r["id"],
        pool=r["pool"],
        info=r["info"],
        state=r["state"],
        token_hash=r["token_hash"],
        registered_at=r["registered_at"],
        last_beat_at=r["last_beat_at"],
        last_seq=r["last_seq"],
        acked_version=r["acked_version"],
        beats=r["beats"],
        metrics=r["metrics"],
    )
