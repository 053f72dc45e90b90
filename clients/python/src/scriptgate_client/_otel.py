"""Optional OpenTelemetry (``opentelemetry-api``), imported on first use.

Without the package (or without an SDK configured) nothing is traced and no
``traceparent`` is sent.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

_api: Any = None
_loaded = False


def api() -> Any:
    """The ``opentelemetry`` API modules, or ``None`` when not installed."""
    global _api, _loaded
    if not _loaded:
        _loaded = True
        try:
            from opentelemetry import context, trace
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError:
            _api = None
        else:

            class Api:
                pass

            a = Api()
            a.trace, a.context, a.propagator = trace, context, TraceContextTextMapPropagator()  # type: ignore[attr-defined]
            _api = a
    return _api


def tracer() -> Any:
    a = api()
    return a.trace.get_tracer("scriptgate_client") if a else None


def start_run_span() -> "tuple[Any, Dict[str, str]]":
    """A ``scriptgate.run_script`` span under the current context, and the
    ``traceparent``/``tracestate`` params that carry it (empty when not recording)."""
    a = api()
    if a is None:
        return None, {}
    span = tracer().start_span("scriptgate.run_script")
    carrier: Dict[str, str] = {}
    if span.get_span_context().is_valid:
        a.propagator.inject(carrier, context=a.trace.set_span_in_context(span))
    return span, {k: carrier[k] for k in ("traceparent", "tracestate") if carrier.get(k)}


def end_span(span: Any, ok: bool, description: Optional[str] = None) -> None:
    a = api()
    if span is None or a is None:
        return
    code = a.trace.StatusCode.OK if ok else a.trace.StatusCode.ERROR
    span.set_status(a.trace.Status(code, None if ok else description))
    span.end()


def start_call_span(
    traceparent: Optional[str], tracestate: Optional[str], attributes: Dict[str, str]
) -> "tuple[Any, Any]":
    """A ``scriptgate.tool_call`` span whose parent is the call's ``traceparent``,
    and the context token of making it current (``detach`` it)."""
    a = api()
    if a is None:
        return None, None
    parent = None
    if traceparent:
        carrier = {"traceparent": traceparent}
        if tracestate:
            carrier["tracestate"] = tracestate
        parent = a.propagator.extract(carrier)
    span = tracer().start_span("scriptgate.tool_call", context=parent, attributes=attributes)
    token = a.context.attach(a.trace.set_span_in_context(span, parent))
    return span, token


def detach(token: Any) -> None:
    a = api()
    if a is not None and token is not None:
        a.context.detach(token)
