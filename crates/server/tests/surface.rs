//! The surface around chat and completions, over SmolLM2-135M on the CPU:
//! `/v1/responses` basic, streamed, structured and with tools through the
//! official OpenAI Python client (`openai_responses.py`), `/props`,
//! `x-request-id`, `/v1/embeddings`. Skipped (with a notice) when the
//! model or Python's `openai` is missing.

mod common;

use braid_engine::LaneConfig;
use braid_server::{Server, ServerConfig};

const CONTEXT: usize = 1024;

async fn start() -> Option<Server> {
    let (lane, info) = common::smollm2::lane(LaneConfig::default(), CONTEXT, 4 * CONTEXT)?;
    let server = Server::bind(ServerConfig { port: 0, model_name: "smollm2".into(), ..ServerConfig::default() }).await.expect("bind");
    server.ready(lane, info);
    Some(server)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_python_client_responses() {
    let Some(python) = std::env::var_os("BRAID_PYTHON") else {
        eprintln!("SKIP: BRAID_PYTHON is not set (scripts/test.sh sets it to a venv with the openai package)");
        return;
    };
    let has = std::process::Command::new(&python).args(["-c", "import openai, jsonschema"]).output().is_ok_and(|o| o.status.success());
    if !has {
        eprintln!("SKIP: {} cannot `import openai, jsonschema`", python.to_string_lossy());
        return;
    }
    let Some(server) = start().await else { return };
    let url = format!("http://{}/v1", server.local_addr());
    let script = format!("{}/tests/openai_responses.py", env!("CARGO_MANIFEST_DIR"));
    let out =
        tokio::task::spawn_blocking(move || std::process::Command::new(python).args([&script, &url, "smollm2"]).output()).await.unwrap().expect("run python");
    let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    eprintln!("{log}");
    assert!(out.status.success(), "the Python client failed:\n{log}");
    for want in [
        "ok: basic response",
        "ok: message-list input",
        "ok: streamed response",
        "ok: streamed equals whole",
        "ok: responses.stream() helper",
        "ok: text.format json_schema",
        "ok: streamed json_schema",
        "ok: named tool_choice",
        "ok: answer after function_call_output",
        "ok: streamed required function_call",
        "ok: x-request-id echoed",
        "ok: props",
        "ok: embeddings refused",
        "ok: previous_response_id refused",
    ] {
        assert!(log.contains(want), "no `{want}` in\n{log}");
    }
    server.shutdown().await.unwrap();
}
