//! A local x402 facilitator double: `POST /verify` and `POST /settle` with
//! answers the test chooses, recording every request. Never a chain.
//!
//! Like [`MockUpstream`](crate::MockUpstream) it runs an actix-web server on
//! a thread of its own and stops when dropped.

use std::net::{SocketAddr, TcpListener};
use std::sync::{Arc, Mutex};

use actix_web::{HttpResponse, web};
use anyhow::Context as _;
use serde_json::{Value, json};

/// How the facilitator answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Behaviour {
    /// Verifies and settles every payment (a fake transaction hash).
    Accept,
    /// `/verify` says `isValid: false` with this reason.
    RefuseVerify(String),
    /// `/settle` says `success: false` with this reason.
    FailSettle(String),
    /// Both answer 503 (as if down behind a proxy).
    Unavailable,
    /// `/verify` accepts, `/settle` answers 503: the settlement may or may
    /// not have been broadcast.
    SettleUnavailable,
}

#[derive(Default)]
struct State {
    behaviour: Mutex<Option<Behaviour>>,
    /// (path, body) of every request.
    log: Mutex<Vec<(String, Value)>>,
}

/// A running facilitator double.
pub struct Facilitator {
    addr: SocketAddr,
    state: Arc<State>,
    _served: crate::server::Served,
}

impl Facilitator {
    /// Starts on `127.0.0.1` with an OS-chosen port, accepting payments.
    pub async fn start() -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").context("binding the facilitator")?;
        let addr = listener.local_addr()?;
        let state = Arc::new(State::default());
        *lock(&state.behaviour) = Some(Behaviour::Accept);
        let data = web::Data::from(Arc::clone(&state));
        let served = crate::server::serve("facilitator", listener, move |app| {
            app.app_data(data.clone())
                .route("/verify", web::post().to(verify))
                .route("/settle", web::post().to(settle));
        })
        .await?;
        Ok(Self {
            addr,
            state,
            _served: served,
        })
    }

    /// `http://127.0.0.1:PORT`, for `x402.facilitator_url`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Changes how later requests are answered.
    pub fn set(&self, behaviour: Behaviour) {
        *lock(&self.state.behaviour) = Some(behaviour);
    }

    /// Every `/settle` body received, in order.
    pub fn settlements(&self) -> Vec<Value> {
        lock(&self.state.log)
            .iter()
            .filter(|(path, _)| path == "settle")
            .map(|(_, body)| body.clone())
            .collect()
    }

    /// Every `/verify` body received, in order.
    pub fn verifications(&self) -> Vec<Value> {
        lock(&self.state.log)
            .iter()
            .filter(|(path, _)| path == "verify")
            .map(|(_, body)| body.clone())
            .collect()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

fn payer(body: &Value) -> Value {
    body["paymentPayload"]["payload"]["authorization"]["from"].clone()
}

async fn verify(state: web::Data<State>, body: web::Json<Value>) -> HttpResponse {
    let body = body.into_inner();
    lock(&state.log).push(("verify".into(), body.clone()));
    match lock(&state.behaviour).clone().unwrap_or(Behaviour::Accept) {
        Behaviour::Unavailable => HttpResponse::ServiceUnavailable().json(json!({"error": "down"})),
        Behaviour::RefuseVerify(reason) => HttpResponse::Ok()
            .json(json!({"isValid": false, "invalidReason": reason, "payer": payer(&body)})),
        _ => HttpResponse::Ok().json(json!({"isValid": true, "payer": payer(&body)})),
    }
}

async fn settle(state: web::Data<State>, body: web::Json<Value>) -> HttpResponse {
    let body = body.into_inner();
    let count = {
        let mut log = lock(&state.log);
        log.push(("settle".into(), body.clone()));
        log.len()
    };
    let network = body["paymentRequirements"]["network"].clone();
    match lock(&state.behaviour).clone().unwrap_or(Behaviour::Accept) {
        Behaviour::Unavailable | Behaviour::SettleUnavailable => {
            HttpResponse::ServiceUnavailable().json(json!({"error": "down"}))
        }
        Behaviour::FailSettle(reason) => HttpResponse::Ok().json(json!({"success": false,
            "errorReason": reason, "transaction": "", "network": network, "payer": payer(&body)})),
        _ => HttpResponse::Ok().json(json!({"success": true,
            "transaction": format!("0x{count:064x}"), "network": network, "payer": payer(&body)})),
    }
}
