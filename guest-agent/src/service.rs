//! The `Agent` ttrpc service: Check answers from [`crate::check`]; Shutdown replies and asks the
//! main thread, through a channel, to end the VM once the reply is on its way.

use std::sync::mpsc::Sender;

use agent_protocol::agent::{CheckRequest, CheckResponse, ShutdownRequest, ShutdownResponse};
use agent_protocol::agent_ttrpc::Agent;
use ttrpc::{Code, TtrpcContext};

/// Sent to the main thread when the host asked for a shutdown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShutdownRequested;

pub struct AgentService {
    shutdown: Sender<ShutdownRequested>,
}

impl AgentService {
    pub fn new(shutdown: Sender<ShutdownRequested>) -> Self {
        Self { shutdown }
    }
}

fn rpc_error(code: Code, message: impl ToString) -> ttrpc::Error {
    ttrpc::Error::RpcStatus(ttrpc::get_status(code, message))
}

impl Agent for AgentService {
    fn check(&self, _ctx: &TtrpcContext, _req: CheckRequest) -> ttrpc::Result<CheckResponse> {
        let facts = crate::check::gather().map_err(|e| {
            log::warn!("check: {e}");
            rpc_error(Code::INTERNAL, e)
        })?;
        Ok(CheckResponse {
            agent_version: env!("CARGO_PKG_VERSION").to_owned(),
            kernel_release: facts.kernel_release,
            online_vcpus: facts.online_vcpus,
            mem_total_kib: facts.mem_total_kib,
            boot_id: facts.boot_id,
            ..Default::default()
        })
    }

    fn shutdown(
        &self,
        _ctx: &TtrpcContext,
        _req: ShutdownRequest,
    ) -> ttrpc::Result<ShutdownResponse> {
        log::info!("shutdown requested by the host");
        self.shutdown
            .send(ShutdownRequested)
            .map_err(|_| rpc_error(Code::UNAVAILABLE, "the agent is already stopping"))?;
        Ok(ShutdownResponse::new())
    }
}
