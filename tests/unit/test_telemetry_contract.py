"""The telemetry contract (dsec.telemetry): what the control plane reads, some producer writes; what a producer
writes, the schema declares; and the docs list exactly the schema's names.

Readers are found by an AST scan (``scan_source``): string literals used as keys of a metrics mapping
(``w.metrics["x"]``, ``m.get("x")`` after ``m = w.metrics``, ``"x" in metrics``, ``helper(metrics, "x")``), the
first argument of ``FeatureSpec(...)``, and every ``telemetry.X`` reference. Producers are run for real where
that is cheap (the probe's per-beat collector, the Hermes plugin's payload) and parsed where it is not (the C
library's ``build_beat``, the Prometheus collector, the policy gauges).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsec import telemetry
from dsec.probe.reporter import Reporter
from dsec.telemetry import HERMES, NATIVE, PROBE, SERVER, WORKER_PRODUCERS, Metric, Producer

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "dsec"
# What decides from worker metrics. dsec/decide is being written in parallel: scanned once it exists.
READER_PATHS = ("control", "decide", "scheduler", "health", "render.py")
POLICY_FILES = (SRC / "data" / "policies", ROOT / "examples" / "policies")

# Names read by modules this branch may not edit that no producer writes. Each entry is a bug to fix in the
# reader (or a producer to write): (name, path relative to the repository). Empty: every read is produced.
KNOWN_UNPRODUCED: frozenset[tuple[str, str]] = frozenset()

# Metric constructors whose first argument is a metric name (health/fleet.py's peer features).
NAME_SINKS = {"FeatureSpec": 0}
_METRIC_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")


@dataclass(frozen=True)
class Read:
    name: str
    path: str
    line: int
    # "worker": a key of a worker's metrics (a worker producer must write it); "any": a schema reference.
    kind: str = "worker"


# -- the reader scan ---------------------------------------------------------------------------------------------
class _Scanner(ast.NodeVisitor):
    def __init__(self, path: str) -> None:
        self.path = path
        self.reads: list[Read] = []
        self.aliases: set[str] = set()  # local names bound to a metrics mapping (m = w.metrics)
        self.modules: set[str] = set()  # names bound to dsec.telemetry
        self.imported: dict[str, str] = {}  # local name -> dsec.telemetry attribute

    def is_metrics(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Name):
            return node.id in self.aliases or "metrics" in node.id.lower()
        if isinstance(node, ast.Attribute):
            return "metrics" in node.attr.lower()
        if isinstance(node, ast.Subscript):  # w["metrics"] in API JSON
            return isinstance(node.slice, ast.Constant) and node.slice.value == "metrics"
        return False

    def add(self, node: ast.AST, kind: str = "worker") -> None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _METRIC_NAME.match(node.value):
            self.reads.append(Read(node.value, self.path, node.lineno, kind))

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if a.name == "dsec.telemetry" and a.asname:
                self.modules.add(a.asname)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for a in node.names:
            if node.module == "dsec" and a.name == "telemetry":
                self.modules.add(a.asname or a.name)
            elif node.module == "dsec.telemetry":
                self.imported[a.asname or a.name] = a.name

    def visit_Assign(self, node: ast.Assign) -> None:
        if self.is_metrics(node.value):
            self.aliases.update(t.id for t in node.targets if isinstance(t, ast.Name))
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if isinstance(node.ctx, ast.Load) and self.is_metrics(node.value):
            self.add(node.slice)
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        if isinstance(node.ops[0], (ast.In, ast.NotIn)) and self.is_metrics(node.comparators[0]):
            self.add(node.left)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in ("get", "pop") and self.is_metrics(f.value) and node.args:
            self.add(node.args[0])
        elif any(self.is_metrics(a) for a in node.args):  # helper(metrics, "name")
            for a in node.args:
                self.add(a)
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        if name in NAME_SINKS and len(node.args) > NAME_SINKS[name]:
            self.add(node.args[NAME_SINKS[name]])
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.value, ast.Name) and node.value.id in self.modules:
            self.schema_ref(node.attr, node.lineno)
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in self.imported:
            self.schema_ref(self.imported[node.id], node.lineno)

    def schema_ref(self, attr: str, line: int) -> None:
        value = getattr(telemetry, attr, None)
        for m in value if isinstance(value, tuple) else (value,):
            if isinstance(m, Metric):
                self.reads.append(Read(m.name, self.path, line, "any"))


def scan_source(source: str, path: str) -> list[Read]:
    tree = ast.parse(source, filename=path)
    s = _Scanner(path)
    for node in ast.walk(tree):  # aliases and imports first, wherever they are bound
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            s.visit(node)
        elif isinstance(node, ast.Assign) and s.is_metrics(node.value):
            s.aliases.update(t.id for t in node.targets if isinstance(t, ast.Name))
    s.visit(tree)
    return s.reads


def _py_files(paths: Iterable[Path]) -> Iterator[Path]:
    for p in paths:
        if p.is_file():
            yield p
        elif p.is_dir():
            yield from sorted(p.rglob("*.py"))


def scan_paths(paths: Iterable[Path], root: Path = ROOT) -> list[Read]:
    reads: list[Read] = []
    for f in _py_files(paths):
        rel = f.relative_to(root).as_posix() if f.is_relative_to(root) else str(f)
        reads += scan_source(f.read_text(), rel)
    return reads


def policy_reads(dirs: Iterable[Path] = POLICY_FILES) -> list[Read]:
    """Metric names the shipped policy files read (compiled: the compiler knows what an expression reads), and
    the names in recorded series files."""
    from dsec.policy import compile_policies

    reads: list[Read] = []
    for d in dirs:
        for f in sorted(d.glob("*.yaml")) if d.is_dir() else ():
            rel = f.relative_to(ROOT).as_posix()
            for rule in compile_policies(f.read_text(), rel).rules:
                exprs = [rule.when] + ([rule.clear_when] if rule.clear_when else [])
                reads += [Read(n, rel, 0, "any") for e in exprs for n in sorted(e.metrics)]
        for f in sorted(d.glob("*.json")) if d.is_dir() else ():
            series = json.loads(f.read_text()).get("series", [])
            reads += [Read(str(s["metric"]), f.relative_to(ROOT).as_posix(), 0, "any") for s in series]
    return reads


def unproduced(reads: Iterable[Read]) -> list[Read]:
    """Reads of a name no producer writes: undeclared, or a worker-metrics key only the server computes."""
    out = []
    for r in reads:
        m = telemetry.lookup(r.name)
        if m is None or (r.kind == "worker" and not set(m.producers) & WORKER_PRODUCERS):
            out.append(r)
    return out


def test_every_metric_the_control_plane_reads_is_produced() -> None:
    reads = scan_paths(SRC / p for p in READER_PATHS) + policy_reads()
    missing = {(r.name, r.path) for r in unproduced(reads)}
    assert missing - KNOWN_UNPRODUCED == set(), [r for r in unproduced(reads) if (r.name, r.path) in missing]
    assert KNOWN_UNPRODUCED - missing == set(), "fixed: remove these from KNOWN_UNPRODUCED"


def test_the_scan_sees_the_readers_it_is_meant_to() -> None:
    reads = {(r.name, r.path) for r in scan_paths(SRC / p for p in READER_PATHS) + policy_reads()}
    for name, path in [
        ("memory_used_gb", "src/dsec/decide/gauges.py"),  # w.metrics["..."], "..." in w.metrics
        ("sync_ok_total", "src/dsec/decide/gauges.py"),  # w.metrics.get
        ("sync_cost_ms_p50", "src/dsec/decide/caps.py"),  # finite(metrics, "...")
        ("memory_growth_gb_per_h", "src/dsec/control/scheduling.py"),  # m = w.metrics; m.get
        ("step_ms_mean", "src/dsec/scheduler/profiles.py"),
        ("sync_lag_ms_p50", "src/dsec/health/fleet.py"),  # FeatureSpec("...")
        ("sync_latency_ms_p99", "src/dsec/render.py"),  # telemetry.SYNC_LATENCY_MS_P99
        ("dsec_melt_down_count", "src/dsec/data/policies/meltdowns-tighten-latency-cap.yaml"),
    ]:
        assert (name, path) in reads


READER_WITH_A_TYPO = """
from dsec import telemetry

def run_record(w):
    m = w.metrics
    leak = m.get("no_such_metric", 0.0)
    return leak + w.metrics["memory_used_gb"] + telemetry.MEMORY_GROWTH_GB_PER_H.name.count("_")

def gauges(ws):
    return sum(1 for w in ws if "dsec_breaker_level" in w.metrics)  # a server gauge is no worker's metric
"""


def test_a_read_of_an_unproduced_name_fails_the_scan(tmp_path: Path) -> None:
    reads = scan_source(READER_WITH_A_TYPO, "src/dsec/control/typo.py")
    assert [(r.name, r.line) for r in unproduced(reads)] == [("no_such_metric", 6), ("dsec_breaker_level", 10)]
    assert {r.name for r in reads} >= {"memory_used_gb", "memory_growth_gb_per_h"}
    # The same through files: a control-plane module with one extra read.
    module = tmp_path / "control" / "gauges.py"
    module.parent.mkdir()
    module.write_text(
        (SRC / "control" / "gauges.py").read_text() + "\n\ndef f(w):\n    return w.metrics['no_such_metric']\n"
    )
    assert [r.name for r in unproduced(scan_paths([tmp_path], root=tmp_path))] == ["no_such_metric"]


# -- producers ---------------------------------------------------------------------------------------------------
def declared(produced: Iterable[str], producer: Producer) -> list[str]:
    """Names ``producer`` wrote that the schema does not declare as written by it."""
    return sorted(n for n in produced if (m := telemetry.lookup(n)) is None or producer not in m.producers)


def schema_names(producer: Producer, templates: bool = True) -> set[str]:
    return {m.name for m in telemetry.METRICS if producer in m.producers and (templates or not m.is_template)}


class _Clock:
    def __init__(self, step: float) -> None:
        self.t, self.step = 0.0, step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


def test_the_probe_writes_only_declared_names_and_every_name_declared_for_it() -> None:
    from dsec.probe.config import ProbeConfig
    from dsec.probe.memory import MemoryTrend
    from dsec.probe.runtime import Probe

    cfg = ProbeConfig.from_env({"DSEC_ENDPOINT": "http://127.0.0.1:9", "DSEC_SANDBOX_ID": "p"})
    assert cfg is not None
    probe = Probe(cfg)  # never registers: no training activity
    probe.memory_trend = MemoryTrend(clock=_Clock(30.0))
    t = probe.telemetry
    for i in range(100):  # enough for every windowed feature (return variance shift: 20 + 60 episodes)
        t.record_sync(1024, 0.002, ok=i % 10 != 0, last=True)
        t.record_arrival(0.001, 0.002)
        t.record_collective("all_reduce", 64, 0.001, ok=True)
        t.record_update(0.01, 1.0 + i / 100)
        t.record_skipped_update()
        t.record_env_steps(5)
        t.record_episode(float(i % 7), 5 + i % 3, terminated=True, truncated=False, interrupted=i % 9 == 0)
    probe.actuators.handle({"version": 1, "memory_quota_gb": 4.0, "memory_limit_gb": 6.0})
    probe.replicas._judge({0: 1, 1: 1}, rank=0, syncs=10)  # one agreeing replica check
    produced: set[str] = set()
    try:
        for _ in range(6):  # the memory slope needs 5 samples over a minute (30 s apart here)
            produced |= set(probe._collect())
    finally:
        probe.close()
    assert declared(produced, PROBE) == []
    # CUDA memory per device is only reported with an initialized GPU (tests/gpu).
    assert schema_names(PROBE, templates=False) - produced == set()


class _QuietReporter(Reporter):
    """The real Reporter, without its thread: the test takes the payload a beat would carry."""

    def start(self) -> Reporter:
        return self


def test_the_hermes_plugin_writes_only_declared_names_and_every_name_declared_for_it() -> None:
    from dsec.integrations.hermes.plugin import HermesMonitor, HermesSettings
    from dsec.probe.reporter import ReporterConfig

    settings = HermesSettings(ReporterConfig(endpoint="http://127.0.0.1:9", pool="p"), stuck_episode_threshold=1000)
    monitor = HermesMonitor(settings, reporter_factory=_QuietReporter)
    hooks = monitor.callbacks
    hooks["on_session_start"](session_id="s")
    for i in range(90):  # enough episodes for the windowed features
        common = {"session_id": "s", "task_id": f"t{i}"}
        hooks["pre_llm_call"](**common, user_message="task", conversation_history=[])
        hooks["pre_api_request"](**common, api_request_id="r1")
        hooks["post_api_request"](
            **common, api_request_id="r1", api_duration=0.01, usage={"input_tokens": 3, "output_tokens": 1}
        )
        hooks["pre_api_request"](**common, api_request_id="r2")
        hooks["api_request_error"](**common, api_request_id="r2", api_duration=0.01)
        hooks["post_tool_call"](**common, tool_name="t", duration_ms=2, status="error" if i % 5 else "ok")
        hooks["post_llm_call"](**common, user_message="", assistant_response=f"{i % 4}")
        hooks["on_session_end"](**common, completed=i % 3 != 0, interrupted=False)
    hooks["pre_llm_call"](session_id="s", task_id="open", user_message="x", conversation_history=[])
    reporter = monitor.reporter
    assert reporter is not None
    produced = set(reporter._take_payload()["metrics"])
    monitor.close()
    assert declared(produced, HERMES) == []
    assert schema_names(HERMES) == produced


def native_beat_names(source: str) -> set[str]:
    """The metric names native/dsec_inject.c's build_beat writes (its add_u64/add_double calls)."""
    body = source[source.index("static char *build_beat") :]
    body = body[: body.index("\n}\n")]
    return set(re.findall(r'add_(?:u64|double)\(&b, &first, "([a-z0-9_]+)"', body))


def test_the_native_library_writes_only_declared_names_and_every_name_declared_for_it() -> None:
    produced = native_beat_names((ROOT / "native" / "dsec_inject.c").read_text())
    assert "cuda_malloc_bytes_total" in produced and "episode_return_mean" in produced
    assert declared(produced, NATIVE) == []
    assert schema_names(NATIVE) == produced


def _first_args(path: Path, calls: set[str]) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in calls:
            out.update(a.value for a in node.args[:1] if isinstance(a, ast.Constant))
    return out


def test_the_server_exposes_and_samples_exactly_its_declared_gauges() -> None:
    exposed = _first_args(SRC / "control" / "metrics.py", {"GaugeMetricFamily", "Counter", "Histogram"})
    assert exposed == {m.name for m in telemetry.METRICS if m.prometheus}
    sampled = set()  # decide/gauges.py policy_samples(): out[("dsec_...", pool, worker)] = ...
    for node in ast.walk(ast.parse((SRC / "decide" / "gauges.py").read_text())):
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Tuple) and node.slice.elts:
            first = node.slice.elts[0]
            if isinstance(first, ast.Constant) and str(first.value).startswith("dsec_"):
                sampled.add(first.value)
    assert sampled == {m.name for m in telemetry.METRICS if m.policy}
    assert all(m.producers == (SERVER,) for m in telemetry.METRICS if m.name.startswith("dsec_"))


# -- the schema and its docs -------------------------------------------------------------------------------------
def test_docs_list_exactly_the_schema() -> None:
    text = (ROOT / "docs" / "telemetry.md").read_text()
    table = text.split("<!-- telemetry-table:begin -->\n", 1)[1].split("<!-- telemetry-table:end -->", 1)[0]
    assert re.findall(r"^\| `([^`]+)` \|", table, re.M) == [m.name for m in telemetry.METRICS]
    assert table == telemetry.markdown_table(), "regenerate the table in docs/telemetry.md (see that file)"


def test_policy_metrics_come_from_the_schema() -> None:
    from dsec.policy import POOL_METRICS, WORKER_METRICS

    assert set(POOL_METRICS) | set(WORKER_METRICS) == {m.name for m in telemetry.METRICS if m.policy}
    assert "dsec_breaker_level" in WORKER_METRICS and "dsec_melt_down_count" in POOL_METRICS


def test_lookup_get_and_templates() -> None:
    assert telemetry.get("memory_used_gb") is telemetry.MEMORY_USED_GB
    assert telemetry.get("cuda3_reserved_gb") is telemetry.CUDA_RESERVED_GB
    assert telemetry.lookup("cudaX_reserved_gb") is None and telemetry.lookup("cuda0_reserved_gbx") is None
    with pytest.raises(KeyError, match="'no_such_metric' is not a declared metric"):
        telemetry.get("no_such_metric")
    assert "llm_call_ms_max" in telemetry.names(HERMES) and "llm_call_ms_max" not in telemetry.names(PROBE)
    with pytest.raises(ValueError, match="no producer"):
        Metric("x", telemetry.Kind.GAUGE, "1", "x", ())
