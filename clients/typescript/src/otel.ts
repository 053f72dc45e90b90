// Optional OpenTelemetry: `@opentelemetry/api`, loaded lazily with a dynamic import.
// Absent (or without a tracer provider registered), nothing is traced and no
// traceparent is sent. Only the few API members used here are typed, so the
// published .d.ts does not need the package.

/* eslint-disable @typescript-eslint/no-explicit-any */

export interface OtelSpanContext {
  traceId: string;
  spanId: string;
  traceFlags: number;
  isRemote?: boolean;
  traceState?: { serialize(): string } | undefined;
}

export interface OtelSpan {
  spanContext(): OtelSpanContext;
  setAttribute(key: string, value: string | number | boolean): unknown;
  setStatus(status: { code: number; message?: string }): unknown;
  recordException(e: unknown): unknown;
  end(): void;
}

/** The part of `@opentelemetry/api` the client uses (pass the module as `tracing`). */
export interface OtelApi {
  trace: {
    getTracer(name: string, version?: string): {
      startSpan(name: string, options?: { attributes?: Record<string, string | number | boolean> }, context?: unknown): OtelSpan;
    };
    setSpan(context: unknown, span: OtelSpan): unknown;
    setSpanContext(context: unknown, spanContext: OtelSpanContext): unknown;
    isSpanContextValid?(spanContext: OtelSpanContext): boolean;
  };
  context: { active(): unknown; with<A extends unknown[], F extends (...args: A) => ReturnType<F>>(context: unknown, fn: F, thisArg?: unknown, ...args: A): ReturnType<F> };
  ROOT_CONTEXT: unknown;
  createTraceState?(raw?: string): { serialize(): string };
}

let loading: Promise<OtelApi | null> | undefined;

/** `@opentelemetry/api` if it can be imported, else null (quietly). Memoized. */
export function loadOtel(): Promise<OtelApi | null> {
  loading ??= (async () => {
    const name = "@opentelemetry/api";
    try {
      const m: any = await import(name);
      const api: any = m && m.trace ? m : m?.default;
      return api && api.trace && api.context ? (api as OtelApi) : null;
    } catch {
      return null;
    }
  })();
  return loading;
}

export const SPAN_OK = 1;
export const SPAN_ERROR = 2;

const TRACEPARENT = /^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$/;

/** The W3C traceparent of a span context, or undefined when it is not valid. */
export function formatTraceparent(api: OtelApi, sc: OtelSpanContext): string | undefined {
  const valid = api.trace.isSpanContextValid
    ? api.trace.isSpanContextValid(sc)
    : /^[0-9a-f]{32}$/.test(sc.traceId) && !/^0+$/.test(sc.traceId) && /^[0-9a-f]{16}$/.test(sc.spanId) && !/^0+$/.test(sc.spanId);
  if (!valid) return undefined;
  return `00-${sc.traceId}-${sc.spanId}-${(sc.traceFlags & 0xff).toString(16).padStart(2, "0")}`;
}

/** The remote span context of a traceparent (and tracestate), or undefined when malformed. */
export function parseTraceparent(api: OtelApi, traceparent: string, tracestate?: string): OtelSpanContext | undefined {
  const m = TRACEPARENT.exec(traceparent);
  if (!m || /^0+$/.test(m[1]!) || /^0+$/.test(m[2]!)) return undefined;
  const sc: OtelSpanContext = { traceId: m[1]!, spanId: m[2]!, traceFlags: parseInt(m[3]!, 16), isRemote: true };
  if (tracestate && api.createTraceState) sc.traceState = api.createTraceState(tracestate);
  return sc;
}
