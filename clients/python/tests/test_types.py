"""Offline checks: snapshot types refuse what the daemon would refuse; tokens verify."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json

import pytest

from scriptgate_client import Limits, PermissionMode, Snapshot, SnapshotError, Tool, ToolClass, error_from_rpc, mint_token
from scriptgate_client.errors import BusyError, NotFoundError, StillRunning, TokenError, ToolsError

KEY = b"k" * 32
SN = {"type": "object", "properties": {"sn": {"type": "string"}}, "required": ["sn"]}


def snap_dict(**over):
    d = {
        "workspace": "/srv/ws/run-1", "permission_mode": "approval",
        "tools": [{"name": "fleet__get", "class": "read", "input_schema": SN},
                  {"name": "fleet__reboot", "class": "write", "input_schema": SN, "frozen": {"tenant": "acme"}},
                  {"name": "fleet__wipe", "class": "destructive"}],
        "limits": {"max_calls": 500, "timeout_s": 60},
    }
    d.update(over)
    return d


def b64d(s: str) -> bytes:
    return base64.urlsafe_b64decode(s + "=" * (-len(s) % 4))


def test_round_trip():
    s = Snapshot.from_dict(snap_dict())
    assert s.permission_mode is PermissionMode.APPROVAL
    assert s.tools[1].tool_class is ToolClass.WRITE
    d = s.to_dict()
    assert d["tools"][1] == {"name": "fleet__reboot", "class": "write", "enabled": True,
                             "input_schema": SN, "frozen": {"tenant": "acme"}}
    assert d["limits"] == {"max_calls": 500, "timeout_s": 60}
    assert Snapshot.from_dict(d).to_dict() == d


@pytest.mark.parametrize("mutate, reason, field", [
    (lambda d: d.update(extra=1), "unknown_field", "extra"),
    (lambda d: d["tools"][0].update(descripton="typo"), "unknown_field", "tools[0].descripton"),
    (lambda d: d["limits"].update(max_memory=1), "unknown_field", "limits.max_memory"),
    (lambda d: d.pop("workspace"), "missing_field", "workspace"),
    (lambda d: d["tools"][0].pop("input_schema"), "missing_field", "tools[0].input_schema"),
    (lambda d: d["tools"][1].pop("input_schema"), "missing_field", "tools[1].input_schema"),
    (lambda d: d["tools"][0].update({"class": "admin"}), "invalid_value", "tools[0].class"),
    (lambda d: d.update(permission_mode="yolo"), "invalid_value", "permission_mode"),
    (lambda d: d.update(workspace="rel/ws"), "not_absolute", "workspace"),
    (lambda d: d["tools"].append(dict(d["tools"][0])), "duplicate_tool", "tools[3].name"),
    (lambda d: d["limits"].update(timeout_s=True), "invalid_value", "limits.timeout_s"),
])
def test_refused_before_sending(mutate, reason, field):
    d = snap_dict()
    mutate(d)
    with pytest.raises(SnapshotError) as e:
        Snapshot.from_dict(d)
    assert (e.value.code, e.value.reason, e.value.field) == (-32011, reason, field)
    with pytest.raises(SnapshotError):
        mint_token(KEY, "run-1", d, 60)


def test_constructors_validate():
    with pytest.raises(SnapshotError):
        Tool("x", "read")  # type: ignore[arg-type]  # no input_schema
    Tool.destructive("x")
    Tool("off", ToolClass.READ, enabled=False)  # never callable: no schema needed
    with pytest.raises(SnapshotError):
        Limits(max_calls=-1)


def test_mint_token_verifies():
    tok = mint_token(KEY, "run-9", snap_dict(), 120, runner="r1", now=1000)
    h, c, s = tok.split(".")
    assert json.loads(b64d(h)) == {"alg": "HS256", "typ": "JWT"}
    claims = json.loads(b64d(c))
    assert claims["run_id"] == "run-9" and claims["runner"] == "r1"
    assert (claims["iat"], claims["exp"]) == (1000, 1120)
    assert claims["snapshot"] == Snapshot.from_dict(snap_dict()).to_dict()
    assert hmac.compare_digest(b64d(s), hmac.new(KEY, f"{h}.{c}".encode(), hashlib.sha256).digest())
    assert "runner" not in json.loads(b64d(mint_token(KEY, "r", snap_dict(), 1).split(".")[1]))
    with pytest.raises(ValueError):
        mint_token(b"short", "r", snap_dict(), 1)


def test_errors_by_code():
    e = error_from_rpc({"code": -32012, "message": "m", "data": {"reason": "not_write", "tool": "t"}})
    assert isinstance(e, ToolsError) and (e.reason, e.tool, e.field) == ("not_write", "t", None)
    assert isinstance(error_from_rpc({"code": -32010, "message": "m"}), TokenError)
    assert isinstance(error_from_rpc({"code": -32015, "message": "m"}), BusyError)
    assert isinstance(error_from_rpc({"code": -32016, "message": "m"}), NotFoundError)
    assert isinstance(error_from_rpc({"code": -32017, "message": "m"}), StillRunning)
    assert error_from_rpc({"code": -1, "message": "m"}).code == -1


def test_the_default_run_as_is_the_packaged_user_where_it_exists(monkeypatch):
    from scriptgate_client import workspace

    real = workspace.pwd.getpwnam

    def without_packaged(name):
        if name == workspace.PACKAGED_RUN_AS:
            raise KeyError(name)
        return real(name)

    monkeypatch.setattr(workspace.pwd, "getpwnam", without_packaged)
    assert workspace.default_run_as() == "nobody"
    monkeypatch.setattr(workspace.pwd, "getpwnam", lambda name: real("nobody"))
    assert workspace.default_run_as() == "scriptgate-script"


# --- issue 20: MCP in, descriptions, answers, error classes ----------------------------

import re
import subprocess
import sys
from pathlib import Path

from scriptgate_client import errors, tool_answer

REPO = Path(__file__).resolve().parents[3]
FIXTURE = json.loads((REPO / "tests" / "fixtures" / "mcp-tools.json").read_text())


def entry(t: Tool) -> dict:
    return {"name": t.name, "class": t.tool_class.value, "enabled": t.enabled,
            "input_schema": t.input_schema, "description": t.description}


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=[c["what"] for c in FIXTURE["cases"]])
def test_from_mcp_fixture(case):
    if case.get("error"):
        with pytest.raises(ValueError):
            Tool.from_mcp(case["tool"], server=case["server"])
        return
    t = Tool.from_mcp(case["tool"], server=case["server"])
    assert entry(t) == case["expect"]
    d = t.to_dict()  # the snapshot entry: description only when there is one
    assert ("description" in d) == (case["expect"]["description"] is not None)
    assert Tool.from_dict(d).to_dict() == d


def test_from_mcp_takes_the_sdk_model():
    types = pytest.importorskip("mcp.types", reason="the mcp SDK (Python 3.10+) is not installed")
    for case in FIXTURE["cases"]:
        if case.get("error") or "inputSchema" not in case["tool"]:
            continue  # the SDK's Tool requires an inputSchema
        model = types.Tool.model_validate(case["tool"])
        assert entry(Tool.from_mcp(model, server=case["server"])) == case["expect"], case["what"]
    with pytest.raises(TypeError):
        Tool.from_mcp(42, server="s")


def test_snapshot_description_accepted_other_unknown_fields_refused():
    d = snap_dict()
    d["tools"][0]["description"] = "Status of one device."
    s = Snapshot.from_dict(d)
    assert s.tools[0].description == "Status of one device."
    assert s.to_dict()["tools"][0]["description"] == "Status of one device."
    d["tools"][0]["title"] = "Status"
    with pytest.raises(SnapshotError) as e:
        Snapshot.from_dict(d)
    assert (e.value.reason, e.value.field) == ("unknown_field", "tools[0].title")
    d["tools"][0].pop("title")
    d["tools"][0]["description"] = 5
    with pytest.raises(SnapshotError) as e:
        Snapshot.from_dict(d)
    assert (e.value.reason, e.value.field) == ("invalid_value", "tools[0].description")


def test_tool_answer_shapes():
    assert tool_answer("t") == {"text": "t", "structured": None, "is_error": False}
    plain = {"text": "x", "structured": {"a": 1}, "is_error": True}
    assert tool_answer(plain) == plain
    mcp_dict = {"content": [{"type": "text", "text": "x"}], "isError": False, "structuredContent": None,
                "resultType": "complete", "_meta": {"k": 1}}
    assert tool_answer(mcp_dict) == {"content": [{"type": "text", "text": "x"}], "isError": False, "_meta": {"k": 1}}
    for bad, problem in [
        ({"text": "x"}, "`is_error` must be present"),
        ({"text": 1, "is_error": False}, "`text` must be a string"),
        ({"text": "x", "is_error": False, "foo": 1}, "unknown field `foo`"),
        ({"foo": 1}, "neither `text`"),
        ({"content": "x"}, "`content` must be an array"),
        ({"content": [{"text": "x"}]}, "content[0] has no string `type`"),
        ({"content": [], "isError": "yes"}, "`isError` must be a boolean"),
        ({"content": [], "structuredContent": [1]}, "`structuredContent` must be an object"),
        ({"content": [], "is_error": True}, "`is_error` in an MCP CallToolResult"),
        ([1], "returned list"),
        (None, "returned NoneType"),
    ]:
        with pytest.raises(ValueError, match=re.escape(problem)):
            tool_answer(bad)


def test_tool_answer_takes_the_sdk_result():
    types = pytest.importorskip("mcp.types", reason="the mcp SDK (Python 3.10+) is not installed")
    r = types.CallToolResult(content=[types.TextContent(type="text", text="hi")], structuredContent={"n": 1})
    assert tool_answer(r) == {"content": [{"type": "text", "text": "hi"}], "structuredContent": {"n": 1},
                              "isError": False}


def test_one_error_class_per_daemon_code():
    """Every code the protocol page names has its class, and no class has a code it does not name."""
    page = (REPO / "man" / "scriptgate-protocol.7").read_text()
    codes = {int(c) for c in re.findall(r"\\?-(32[0-9]{3})\b", page)}
    codes = {-c for c in codes}
    assert {-32001, -32010, -32011, -32012, -32013, -32015, -32016, -32017, -32018, -32700, -32600, -32601,
            -32602, -32603} <= codes, codes
    assert set(errors.ERRORS_BY_CODE) == codes
    for code, cls in errors.ERRORS_BY_CODE.items():
        e = error_from_rpc({"code": code, "message": "m", "data": {"reason": "r"}})
        assert type(e) is cls and e.code == code and e.reason == "r"


def test_standard_library_only():
    """Without mcp, pydantic and opentelemetry the client imports and works."""
    code = """
import sys
for m in ("mcp", "pydantic", "opentelemetry"):
    sys.modules[m] = None  # import fails
import scriptgate_client as sc
from scriptgate_client import _otel
t = sc.Tool.from_mcp({"name": "echo", "inputSchema": {"type": "object"}, "annotations": {"readOnlyHint": True}}, "s")
assert t.name == "s__echo" and t.tool_class.value == "read"
assert sc.tool_answer({"content": []}) == {"content": []}
assert _otel.api() is None and _otel.start_run_span() == (None, {})
print("ok")
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout == "ok\n", p.stderr
