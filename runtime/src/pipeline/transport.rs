//! Moving activations and gradients between neighbouring stages.

use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};

use tch::Tensor;

/// Named tensors of one microbatch.
pub type Named = Vec<(String, Tensor)>;

/// A stage's link to its neighbours (stage k-1 upstream, k+1 downstream) and to the
/// cross-stage reduction. Errors are messages; a closed peer is an error, never a hang.
pub trait Transport: Send {
    /// Sends microbatch `mb`'s activations to the next stage.
    fn send_forward(&mut self, mb: u64, tensors: Named) -> Result<(), String>;
    /// Receives microbatch `mb`'s activations from the previous stage.
    fn recv_forward(&mut self, mb: u64) -> Result<Named, String>;
    /// Sends microbatch `mb`'s input gradients to the previous stage.
    fn send_backward(&mut self, mb: u64, grads: Named) -> Result<(), String>;
    /// Receives microbatch `mb`'s output gradients from the next stage.
    fn recv_backward(&mut self, mb: u64) -> Result<Named, String>;
    /// Sum of `x` over every stage (each stage calls it the same number of times).
    fn all_reduce_sum(&mut self, x: f64) -> Result<f64, String>;
    /// Makes every pending and future reduction fail (a stage has failed).
    fn abort(&mut self);
}

struct Msg {
    mb: u64,
    tensors: Named,
}

/// Stages as threads of one process, linked by `std::sync::mpsc` channels.
pub struct InProcess {
    fwd_in: Option<Receiver<Msg>>,
    fwd_out: Option<Sender<Msg>>,
    bwd_in: Option<Receiver<Msg>>,
    bwd_out: Option<Sender<Msg>>,
    reducer: Arc<Reducer>,
}

impl InProcess {
    /// One transport per stage of a `depth`-stage pipeline, in stage order.
    pub fn pipeline(depth: usize) -> Vec<InProcess> {
        let reducer = Arc::new(Reducer::new(depth));
        let mut ts: Vec<InProcess> = (0..depth)
            .map(|_| InProcess { fwd_in: None, fwd_out: None, bwd_in: None, bwd_out: None, reducer: reducer.clone() })
            .collect();
        for k in 0..depth.saturating_sub(1) {
            let (ftx, frx) = std::sync::mpsc::channel();
            let (btx, brx) = std::sync::mpsc::channel();
            ts[k].fwd_out = Some(ftx);
            ts[k + 1].fwd_in = Some(frx);
            ts[k + 1].bwd_out = Some(btx);
            ts[k].bwd_in = Some(brx);
        }
        ts
    }
}

fn send(tx: &Option<Sender<Msg>>, mb: u64, tensors: Named, what: &str) -> Result<(), String> {
    let tx = tx.as_ref().ok_or_else(|| format!("no {what} neighbour"))?;
    tx.send(Msg { mb, tensors }).map_err(|_| format!("{what} neighbour has stopped"))
}

fn recv(rx: &Option<Receiver<Msg>>, mb: u64, what: &str) -> Result<Named, String> {
    let rx = rx.as_ref().ok_or_else(|| format!("no {what} neighbour"))?;
    let msg = rx.recv().map_err(|_| format!("{what} neighbour has stopped"))?;
    if msg.mb != mb {
        return Err(format!("expected microbatch {mb} from the {what} neighbour, got {}", msg.mb));
    }
    Ok(msg.tensors)
}

impl Transport for InProcess {
    fn send_forward(&mut self, mb: u64, tensors: Named) -> Result<(), String> {
        send(&self.fwd_out, mb, tensors, "next")
    }
    fn recv_forward(&mut self, mb: u64) -> Result<Named, String> {
        recv(&self.fwd_in, mb, "previous")
    }
    fn send_backward(&mut self, mb: u64, grads: Named) -> Result<(), String> {
        send(&self.bwd_out, mb, grads, "previous")
    }
    fn recv_backward(&mut self, mb: u64) -> Result<Named, String> {
        recv(&self.bwd_in, mb, "next")
    }
    fn all_reduce_sum(&mut self, x: f64) -> Result<f64, String> {
        self.reducer.all_reduce(x)
    }
    fn abort(&mut self) {
        self.reducer.abort();
    }
}

/// A reusable sum-barrier over a fixed number of participants.
struct Reducer {
    n: usize,
    state: Mutex<RState>,
    cv: Condvar,
}

#[derive(Default)]
struct RState {
    generation: u64,
    count: usize,
    acc: f64,
    result: f64,
    aborted: bool,
}

impl Reducer {
    fn new(n: usize) -> Self {
        Reducer { n, state: Mutex::new(RState::default()), cv: Condvar::new() }
    }

    fn all_reduce(&self, x: f64) -> Result<f64, String> {
        let aborted = || "all-reduce aborted: another stage has stopped".to_string();
        let mut s = self.state.lock().map_err(|_| aborted())?;
        if s.aborted {
            return Err(aborted());
        }
        let gen = s.generation;
        s.acc += x;
        s.count += 1;
        if s.count == self.n {
            s.result = s.acc;
            s.acc = 0.0;
            s.count = 0;
            s.generation += 1;
            self.cv.notify_all();
            return Ok(s.result);
        }
        while s.generation == gen && !s.aborted {
            s = self.cv.wait(s).map_err(|_| aborted())?;
        }
        if s.generation == gen {
            Err(aborted())
        } else {
            Ok(s.result)
        }
    }

    fn abort(&self) {
        if let Ok(mut s) = self.state.lock() {
            s.aborted = true;
        }
        self.cv.notify_all();
    }
}
