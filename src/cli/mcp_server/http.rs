//! `scriptgate mcp --http`: MCP's Streamable HTTP on loopback (rmcp's tower service
//! under hyper), with the bounds one client may hold.

use super::server::CodeMode;
use crate::cli::exit::Failure;
use std::sync::Arc;
use std::time::Duration;

/// MCP's Streamable HTTP at `http://ADDR/mcp`, on loopback only. The `Host`
/// header must name a loopback host and a browser's `Origin` must be this
/// server's own (DNS rebinding, which the MCP spec asks servers to stop); a client
/// that sends no `Origin` (not a browser) is served.
pub(super) async fn serve_http(
    server: CodeMode,
    addr: std::net::SocketAddr,
) -> Result<(), Failure> {
    use rmcp::transport::streamable_http_server::{
        session::local::LocalSessionManager, StreamableHttpServerConfig, StreamableHttpService,
    };
    if !addr.ip().is_loopback() {
        return Err(Failure::usage(format!(
            "--http {addr}: loopback addresses only (127.0.0.1:PORT or [::1]:PORT)"
        )));
    }
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| Failure::setup(format!("--http {addr}: {e}")))?;
    let bound = listener
        .local_addr()
        .map_err(|e| Failure::setup(format!("--http {addr}: {e}")))?;
    let port = bound.port();
    let config = StreamableHttpServerConfig::default()
        .with_allowed_origins([
            format!("http://localhost:{port}"),
            format!("http://127.0.0.1:{port}"),
            format!("http://[::1]:{port}"),
        ])
        .enforce_origin_validation();
    let service = StreamableHttpService::new(
        move || Ok(server.clone()),
        Arc::new(Capped(LocalSessionManager::default())),
        config,
    );
    let connections = Arc::new(tokio::sync::Semaphore::new(MAX_HTTP_CONNECTIONS));
    eprintln!("scriptgate mcp: Streamable HTTP at http://{bound}/mcp");
    loop {
        // Past MAX_HTTP_CONNECTIONS at once, the next waits in the listen backlog.
        let Ok(slot) = connections.clone().acquire_owned().await else {
            return Ok(());
        };
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                eprintln!("scriptgate mcp: accept: {e}");
                continue;
            }
        };
        let service = service.clone();
        tokio::spawn(async move {
            let _slot = slot;
            // Every path is the MCP endpoint; /mcp is the one documented.
            let svc = hyper_util::service::TowerToHyperService::new(service);
            let io = hyper_util::rt::TokioIo::new(stream);
            // A connection that sends no request headers within HEADER_TIMEOUT is
            // closed, so idle ones cannot hold the MAX_HTTP_CONNECTIONS slots.
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(io, svc)
                .await;
        });
    }
}

/// keep-alive included.
const HEADER_TIMEOUT: Duration = Duration::from_secs(30);
/// HTTP connections served at once (`--http`).
const MAX_HTTP_CONNECTIONS: usize = 64;
/// MCP sessions at once (`--http`): each holds a server task and its channels
/// until the client ends it (DELETE) or 5 minutes pass without a request.
pub const MAX_HTTP_SESSIONS: usize = 32;

/// rmcp's in-memory sessions, at most `MAX_HTTP_SESSIONS` of them: one more is
/// refused (the client gets an HTTP error naming the bound).
struct Capped(rmcp::transport::streamable_http_server::session::local::LocalSessionManager);

#[derive(Debug, thiserror::Error)]
enum SessionError {
    #[error("{0}")]
    Local(
        #[from] rmcp::transport::streamable_http_server::session::local::LocalSessionManagerError,
    ),
    #[error("too many MCP sessions at once (at most {MAX_HTTP_SESSIONS}); end one (DELETE) or wait 5 minutes")]
    TooMany,
}

impl rmcp::transport::streamable_http_server::SessionManager for Capped {
    type Error = SessionError;
    type Transport = <rmcp::transport::streamable_http_server::session::local::LocalSessionManager as rmcp::transport::streamable_http_server::SessionManager>::Transport;

    async fn create_session(
        &self,
    ) -> Result<
        (
            rmcp::transport::common::server_side_http::SessionId,
            Self::Transport,
        ),
        SessionError,
    > {
        // The count and the insert are two steps: requests racing past the check
        // exceed the bound by at most the connections served at once.
        if self.0.sessions.read().await.len() >= MAX_HTTP_SESSIONS {
            return Err(SessionError::TooMany);
        }
        Ok(self.0.create_session().await?)
    }
    async fn initialize_session(
        &self,
        id: &rmcp::transport::common::server_side_http::SessionId,
        message: rmcp::model::ClientJsonRpcMessage,
    ) -> Result<rmcp::model::ServerJsonRpcMessage, SessionError> {
        Ok(self.0.initialize_session(id, message).await?)
    }
    async fn has_session(
        &self,
        id: &rmcp::transport::common::server_side_http::SessionId,
    ) -> Result<bool, SessionError> {
        Ok(self.0.has_session(id).await?)
    }
    async fn close_session(
        &self,
        id: &rmcp::transport::common::server_side_http::SessionId,
    ) -> Result<(), SessionError> {
        Ok(self.0.close_session(id).await?)
    }
    async fn create_stream(
        &self,
        id: &rmcp::transport::common::server_side_http::SessionId,
        message: rmcp::model::ClientJsonRpcMessage,
    ) -> Result<
        impl futures::Stream<Item = rmcp::transport::common::server_side_http::ServerSseMessage>
            + Send
            + Sync
            + 'static,
        SessionError,
    > {
        Ok(self.0.create_stream(id, message).await?)
    }
    async fn accept_message(
        &self,
        id: &rmcp::transport::common::server_side_http::SessionId,
        message: rmcp::model::ClientJsonRpcMessage,
    ) -> Result<(), SessionError> {
        Ok(self.0.accept_message(id, message).await?)
    }
    async fn create_standalone_stream(
        &self,
        id: &rmcp::transport::common::server_side_http::SessionId,
    ) -> Result<
        impl futures::Stream<Item = rmcp::transport::common::server_side_http::ServerSseMessage>
            + Send
            + Sync
            + 'static,
        SessionError,
    > {
        Ok(self.0.create_standalone_stream(id).await?)
    }
    async fn resume(
        &self,
        id: &rmcp::transport::common::server_side_http::SessionId,
        last_event_id: String,
    ) -> Result<
        impl futures::Stream<Item = rmcp::transport::common::server_side_http::ServerSseMessage>
            + Send
            + Sync
            + 'static,
        SessionError,
    > {
        Ok(self.0.resume(id, last_event_id).await?)
    }
}
