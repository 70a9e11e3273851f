"""dsec.yamlconf: config errors name file:line:col and the field, for every problem in the file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dsec.control.schemas import ClusterSpec
from dsec.yamlconf import ConfigError, format_loc, load_file, load_marked, locate, validate

GOOD = """\
pools:
  - name: pool-a
    devices: [gpu0, gpu1]
    memory_base_gb: 4
  - name: pool-b
devices:
  - {id: gpu0, node: n0, memory_gb: 80}
"""


def write(tmp_path: Path, text: str, name: str = "cluster.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def problems(tmp_path: Path, text: str) -> tuple[Path, list[str]]:
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as exc:
        load_file(ClusterSpec, p)
    assert str(exc.value) == "\n".join(exc.value.problems)
    return p, exc.value.problems


def test_valid_file_loads(tmp_path: Path) -> None:
    spec = load_file(ClusterSpec, write(tmp_path, GOOD))
    assert [p.name for p in spec.pools] == ["pool-a", "pool-b"]
    assert spec.pools[0].devices == ["gpu0", "gpu1"] and spec.pools[0].memory_base_gb == 4.0
    assert spec.devices[0].memory_gb == 80.0


def test_the_example_cluster_file_is_valid() -> None:
    root = Path(__file__).resolve().parents[2]
    for path in (root / "examples" / "cluster.yaml", root / "src" / "dsec" / "data" / "cluster.yaml"):
        if path.exists():
            assert load_file(ClusterSpec, path).pools


def test_empty_file_is_the_empty_cluster(tmp_path: Path) -> None:
    assert load_file(ClusterSpec, write(tmp_path, "")) == ClusterSpec()
    assert load_file(ClusterSpec, write(tmp_path, "# only a comment\n")) == ClusterSpec()


def test_schema_error_names_file_line_col_and_field(tmp_path: Path) -> None:
    p, probs = problems(tmp_path, "pools:\n  - name: a\n  - name: b\n    memory_base_gb: -1\n")
    assert probs == [f"{p}:4:5: pools[1].memory_base_gb: Input should be greater than or equal to 0"]


def test_every_problem_is_reported_in_file_order(tmp_path: Path) -> None:
    text = (
        "pools:\n"
        "  - name: a\n"
        "    memory_base_gb: big\n"
        "    colour: red\n"
        "devices:\n"
        "  - id: gpu0\n"
        "    node: n0\n"
        "    numa_node: -5\n"
    )
    p, probs = problems(tmp_path, text)
    assert probs == [
        f"{p}:3:5: pools[0].memory_base_gb: Input should be a valid number",
        f"{p}:4:5: pools[0].colour: Extra inputs are not permitted",
        f"{p}:8:5: devices[0].numa_node: Input should be greater than or equal to -1",
    ]


def test_missing_field_points_at_its_parent(tmp_path: Path) -> None:
    p, probs = problems(tmp_path, "pools:\n  - name: a\n  - memory_base_gb: 1\n")
    assert probs == [f"{p}:3:5: pools[1].name: Field required"]


def test_flow_sequence_item_is_located_at_the_item(tmp_path: Path) -> None:
    p, probs = problems(tmp_path, "pools:\n  - name: a\n    devices: [ok, -bad]\n")
    assert len(probs) == 1
    assert probs[0].startswith(f"{p}:3:19: pools[0].devices[1]: String should match pattern")


def test_cross_field_error_points_at_the_later_field(tmp_path: Path) -> None:
    p, probs = problems(tmp_path, "pools:\n  - name: a\n    memory_base_gb: 10\n    memory_ceiling_gb: 5\n")
    assert probs == [
        f"{p}:4:5: pools[0].memory_ceiling_gb: Value error, memory_ceiling_gb (5) must be >= memory_base_gb (10)"
    ]


def test_non_finite_number_is_rejected(tmp_path: Path) -> None:
    p, probs = problems(tmp_path, "pools:\n  - name: a\n    memory_base_gb: .nan\n")
    assert probs == [f"{p}:3:5: pools[0].memory_base_gb: Input should be a finite number"]


def test_wrong_root_type(tmp_path: Path) -> None:
    p, probs = problems(tmp_path, "- 1\n- 2\n")
    assert len(probs) == 1 and probs[0].startswith(f"{p}:1:1: <root>: Input should be a valid dictionary")


@pytest.mark.parametrize(
    ("text", "line", "col", "what"),
    [
        ("pools: [\n  - x", 2, 3, "expected the node content, but found '-'"),
        ("key: [unclosed\n", 2, 1, "expected ',' or ']'"),
        ("a: b: c\n", 1, 5, "mapping values are not allowed here"),
        ("pools:\n  - name: a\n\tbad: tab\n", 3, 1, "found character '\\t' that cannot start any token"),
    ],
)
def test_invalid_yaml_names_file_line_col(tmp_path: Path, text: str, line: int, col: int, what: str) -> None:
    p, probs = problems(tmp_path, text)
    assert len(probs) == 1
    assert probs[0].startswith(f"{p}:{line}:{col}: invalid YAML: "), probs[0]
    assert what in probs[0]


def test_duplicate_key_names_file_line_col(tmp_path: Path) -> None:
    p, probs = problems(tmp_path, "pools:\n  - name: a\n    memory_base_gb: 1\n    memory_base_gb: 2\n")
    assert probs == [f"{p}:4:5: duplicate key 'memory_base_gb'"]


def test_unreadable_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as exc:
        load_file(ClusterSpec, missing)
    assert exc.value.problems == [f"{missing}: cannot read: No such file or directory"]
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path}: cannot read")):
        load_file(ClusterSpec, tmp_path)  # a directory


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)
    err = ConfigError(["a:1:1: x", "a:2:1: y"])
    assert str(err) == "a:1:1: x\na:2:1: y" and err.problems == ["a:1:1: x", "a:2:1: y"]


def test_load_marked_keeps_types_and_positions() -> None:
    m = load_marked("a: 1\nb:\n  - true\n  - '007'\n  - 2.5\n  - null\nc: {d: x}\n", "s.yaml")
    assert m.data == {"a": 1, "b": [True, "007", 2.5, None], "c": {"d": "x"}}
    assert m.marks[()] == (1, 1)
    assert m.marks[("a",)] == (1, 1)  # a mapping value is located at its key
    assert m.marks[("b", 1)] == (4, 5)  # a sequence item at its own start
    assert m.marks[("c", "d")] == (7, 5)


def test_load_marked_without_a_file_uses_the_source_name() -> None:
    with pytest.raises(ConfigError, match=r"^<string>:1:5: invalid YAML"):
        load_marked("a: b: c")
    with pytest.raises(ConfigError, match=r"^inline:2:1: duplicate key 'a'$"):
        load_marked("a: 1\na: 2\n", "inline")


def test_validate_uses_the_given_source() -> None:
    with pytest.raises(ConfigError) as exc:
        validate(ClusterSpec, load_marked("pools: 3\n"), "from-env")
    assert exc.value.problems[0].startswith("from-env:1:1: pools: Input should be a valid list")


def test_locate_falls_back_to_the_nearest_ancestor() -> None:
    marks = {(): (1, 1), ("pools",): (2, 1), ("pools", 0): (3, 5)}
    assert locate(marks, ("pools", 0, "name")) == (3, 5)
    assert locate(marks, ("pools", 7, "x", "y")) == (2, 1)
    assert locate(marks, ("other",)) == (1, 1)
    assert locate({}, ("a",)) == (1, 1)


@pytest.mark.parametrize(
    ("loc", "text"),
    [
        ((), "<root>"),
        (("pools",), "pools"),
        (("pools", 2, "memory_base_gb"), "pools[2].memory_base_gb"),
        (("a", 0, 1, "b"), "a[0][1].b"),
    ],
)
def test_format_loc(loc: tuple[str | int, ...], text: str) -> None:
    assert format_loc(loc) == text


def test_merge_keys_are_expanded(tmp_path: Path) -> None:
    text = "base: &base\n  memory_base_gb: 2\n  memory_ceiling_gb: 3\npools:\n  - <<: *base\n    name: a\n"
    m = load_marked(text, "m.yaml")
    assert m.data["pools"][0] == {"memory_base_gb": 2, "memory_ceiling_gb": 3, "name": "a"}
