// The MCP SDK's .d.ts names the DOM's HeadersInit (for its HTTP transports), which
// @types/node 18 does not declare; the stdio client the tests use needs nothing more.
type HeadersInit = [string, string][] | Record<string, string>;
