//! Workers in separate processes (on one machine or several), linked by TCP: the same
//! [`Transport`] the in-process executor uses, so a stage process runs the very schedule
//! the embedded executor runs.
//!
//! Ranks are `replica * depth + stage` (the order an MPI launcher gives MPMD programs
//! listed stage by stage). Rank 0 also runs the coordinator: every rank connects to it
//! at the rendezvous address and says its rank, its compile's pipeline id and the
//! address it listens on; the coordinator checks them and sends everyone the address
//! table. Neighbouring stages of a replica then open one direct connection, over which
//! activations go down and gradients come up. Reductions (gradient norm, tied weights,
//! replicas) go through the coordinator, which sums contributions in rank order, so
//! results match the in-process executor bit for bit.
//!
//! Every connection has a reader and a writer thread with unbounded queues, so sends
//! never block (as with in-process channels) and a closed peer is an error, not a hang.

use std::collections::HashMap;
use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::mpsc::{self, Receiver, Sender};
use std::time::{Duration, Instant};

use tch::Tensor;

use super::transport::{Named, Transport};
use crate::exec::{tensor_from_bytes, tensor_to_bytes};
use crate::kernel::ElemType;

/// Where a worker stands in the job and how it finds the others.
#[derive(Clone, Debug)]
pub struct TcpOptions {
    pub rank: usize,
    pub depth: usize,
    pub replicas: usize,
    /// `host:port` where rank 0 listens.
    pub rendezvous: String,
    /// The stage modules' compile id; every rank must have the same.
    pub pipeline: String,
    /// Names of the tensors this stage receives from the previous one, and sends to the
    /// next, in order (checked against the neighbours).
    pub recv_names: Vec<String>,
    pub send_names: Vec<String>,
    /// How long to wait for the coordinator, the other workers and the neighbours at start.
    pub timeout: Duration,
    /// How long a wait for a neighbour's tensors or a reduction's result may last once
    /// training runs (a frozen peer ends in an error naming it, not a hang).
    pub idle_timeout: Duration,
}

const HELLO: u8 = 1;
const TABLE: u8 = 2;
const FORWARD: u8 = 3;
const BACKWARD: u8 = 4;
const REDUCE: u8 = 5;
const RESULT: u8 = 6;
const ERROR: u8 = 7;
const NEIGHBOUR: u8 = 8;

/// One message. `text` carries names, addresses or an error message.
#[derive(Default)]
struct Frame {
    kind: u8,
    a: u64,
    b: u64,
    value: f64,
    text: Vec<String>,
    tensors: Vec<(String, ElemType, Vec<i64>, Vec<u8>)>,
}

fn put_bytes(w: &mut impl Write, b: &[u8]) -> std::io::Result<()> {
    w.write_all(&(b.len() as u64).to_le_bytes())?;
    w.write_all(b)
}

fn get_u64(r: &mut impl Read) -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

fn get_bytes(r: &mut impl Read) -> std::io::Result<Vec<u8>> {
    let n = get_u64(r)?;
    if n > 1 << 40 {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "frame field too large"));
    }
    let mut v = vec![0u8; n as usize];
    r.read_exact(&mut v)?;
    Ok(v)
}

fn get_string(r: &mut impl Read) -> std::io::Result<String> {
    String::from_utf8(get_bytes(r)?).map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8"))
}

impl Frame {
    fn write(&self, w: &mut impl Write) -> std::io::Result<()> {
        w.write_all(b"PWF1")?;
        w.write_all(&[self.kind])?;
        w.write_all(&self.a.to_le_bytes())?;
        w.write_all(&self.b.to_le_bytes())?;
        w.write_all(&self.value.to_le_bytes())?;
        w.write_all(&(self.text.len() as u64).to_le_bytes())?;
        for t in &self.text {
            put_bytes(w, t.as_bytes())?;
        }
        w.write_all(&(self.tensors.len() as u64).to_le_bytes())?;
        for (name, elem, dims, data) in &self.tensors {
            put_bytes(w, name.as_bytes())?;
            put_bytes(w, elem.name().as_bytes())?;
            w.write_all(&(dims.len() as u64).to_le_bytes())?;
            for d in dims {
                w.write_all(&d.to_le_bytes())?;
            }
            put_bytes(w, data)?;
        }
        w.flush()
    }

    fn read(r: &mut impl Read) -> std::io::Result<Frame> {
        let bad = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, m.to_string());
        let mut head = [0u8; 5];
        r.read_exact(&mut head)?;
        if &head[..4] != b"PWF1" {
            return Err(bad("not a pipewright frame (is another program on this port?)"));
        }
        let (a, b) = (get_u64(r)?, get_u64(r)?);
        let value = f64::from_bits(get_u64(r)?);
        let n_text = get_u64(r)?;
        let text = (0..n_text.min(1 << 20)).map(|_| get_string(r)).collect::<Result<_, _>>()?;
        let n = get_u64(r)?;
        let mut tensors = Vec::new();
        for _ in 0..n.min(1 << 20) {
            let name = get_string(r)?;
            let elem = ElemType::from_name(&get_string(r)?).ok_or_else(|| bad("unknown element type"))?;
            let nd = get_u64(r)?.min(64);
            let dims = (0..nd).map(|_| get_u64(r).map(|d| d as i64)).collect::<Result<_, _>>()?;
            tensors.push((name, elem, dims, get_bytes(r)?));
        }
        Ok(Frame { kind: head[4], a, b, value, text, tensors })
    }

    fn with_tensors(kind: u8, a: u64, b: u64, ts: &[(String, Tensor)]) -> Result<Frame, String> {
        let tensors = ts
            .iter()
            .map(|(n, t)| tensor_to_bytes(t).map(|(e, d, b)| (n.clone(), e, d, b)).map_err(|e| format!("tensor {n:?}: {e}")))
            .collect::<Result<_, _>>()?;
        Ok(Frame { kind, a, b, tensors, ..Frame::default() })
    }

    fn tensors(&self) -> Result<Named, String> {
        self.tensors
            .iter()
            .map(|(n, e, d, b)| tensor_from_bytes(*e, d, b).map(|t| (n.clone(), t)).map_err(|e| format!("tensor {n:?}: {e}")))
            .collect()
    }

    fn error(message: String) -> Frame {
        Frame { kind: ERROR, text: vec![message], ..Frame::default() }
    }
}

/// A connection with a reader and a writer thread. Dropping it sends what is queued
/// before it returns, so a process that exits right after its last send loses nothing.
struct Link {
    tx: Option<Sender<Frame>>,
    rx: Receiver<Frame>,
    writer: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Link {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(h) = self.writer.take() {
            let _ = h.join();
        }
    }
}

impl Link {
    fn new(stream: TcpStream) -> Result<Link, String> {
        let _ = stream.set_nodelay(true);
        let read_half = stream.try_clone().map_err(|e| format!("cannot share the connection: {e}"))?;
        let (tx, to_write) = mpsc::channel::<Frame>();
        let (received, rx) = mpsc::channel::<Frame>();
        let writer = std::thread::spawn(move || {
            let mut w = BufWriter::new(stream);
            for f in to_write {
                if f.write(&mut w).is_err() {
                    break;
                }
            }
            if let Ok(s) = w.into_inner() {
                let _ = s.shutdown(std::net::Shutdown::Write);
            }
        });
        std::thread::spawn(move || {
            let mut r = BufReader::new(read_half);
            while let Ok(f) = Frame::read(&mut r) {
                if received.send(f).is_err() {
                    break;
                }
            }
        });
        Ok(Link { tx: Some(tx), rx, writer: Some(writer) })
    }

    fn send(&self, f: Frame, who: &str) -> Result<(), String> {
        let closed = || format!("the connection to the {who} is closed");
        self.tx.as_ref().ok_or_else(closed)?.send(f).map_err(|_| closed())
    }

    fn sender(&self) -> Option<Sender<Frame>> {
        self.tx.clone()
    }

    /// The next frame within `timeout`; an error frame, a closed connection or silence is an
    /// error.
    fn recv(&self, who: &str, timeout: Duration) -> Result<Frame, String> {
        let f = self.rx.recv_timeout(timeout).map_err(|e| match e {
            mpsc::RecvTimeoutError::Timeout => format!("waited {} s for the {who}, which sent nothing", timeout.as_secs_f64()),
            mpsc::RecvTimeoutError::Disconnected => format!("the {who} has stopped (connection closed)"),
        })?;
        if f.kind == ERROR {
            return Err(format!("the {who} reports: {}", f.text.first().cloned().unwrap_or_default()));
        }
        Ok(f)
    }
}

/// Reduction groups as numbers: everyone; the replicas of stage `k`; the stages `set`
/// (bit mask) of replica `r` sharing tied weights.
fn group_everyone() -> u64 {
    0
}
fn group_replicas(stage: u32) -> u64 {
    (1 << 56) | u64::from(stage)
}
fn group_tied(replica: usize, stages: &[u32]) -> u64 {
    let mask = stages.iter().fold(0u64, |m, s| m | (1 << s));
    (2 << 56) | ((replica as u64) << 32) | mask
}

/// The ranks of a group, ascending.
fn members(group: u64, depth: usize, replicas: usize) -> Vec<usize> {
    match group >> 56 {
        0 => (0..depth * replicas).collect(),
        1 => (0..replicas).map(|r| r * depth + (group & 0xffff_ffff) as usize).collect(),
        _ => {
            let r = ((group >> 32) & 0xff_ffff) as usize;
            (0..depth.min(32)).filter(|s| group & (1 << s) != 0).map(|s| r * depth + s).collect()
        }
    }
}

/// A worker's TCP links.
pub struct Tcp {
    opts: TcpOptions,
    stage: u32,
    replica: usize,
    prev: Option<Link>,
    next: Option<Link>,
    hub: Option<Link>,
    seq: HashMap<u64, u64>,
    /// Rank 0: the coordinator, which must outlive every other worker's last reduction.
    coordinator: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Tcp {
    fn drop(&mut self) {
        // Flush and close the links, then (rank 0) wait until every worker has gone.
        self.prev = None;
        self.next = None;
        self.hub = None;
        if let Some(h) = self.coordinator.take() {
            let _ = h.join();
        }
    }
}

fn connect_retrying(addr: &str, timeout: Duration) -> Result<TcpStream, String> {
    let deadline = Instant::now() + timeout;
    loop {
        let addrs: Vec<SocketAddr> = addr.to_socket_addrs().map_err(|e| format!("rendezvous address {addr:?}: {e}"))?.collect();
        for a in &addrs {
            if let Ok(s) = TcpStream::connect_timeout(a, Duration::from_secs(2)) {
                return Ok(s);
            }
        }
        if Instant::now() >= deadline {
            return Err(format!("cannot reach {addr} within {}s (is rank 0 running?)", timeout.as_secs()));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn accept_until(listener: &TcpListener, deadline: Instant, what: &str) -> Result<TcpStream, String> {
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    loop {
        match listener.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false).map_err(|e| e.to_string())?;
                return Ok(s);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(format!("no {what} connected in time"));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(format!("accepting the {what}: {e}")),
        }
    }
}

impl Tcp {
    /// Joins the job: rank 0 starts the coordinator first; everyone registers, gets the
    /// address table and connects to its neighbours. Fails with a message naming what
    /// disagrees (pipeline id, ranks, boundary tensors) or who did not show up.
    pub fn connect(opts: TcpOptions) -> Result<Tcp, String> {
        let world = opts.depth * opts.replicas;
        if opts.rank >= world {
            return Err(format!("rank {} but the job has {world} workers ({} stages x {} replicas)", opts.rank, opts.depth, opts.replicas));
        }
        if opts.depth > 32 {
            return Err("the TCP transport supports at most 32 stages".into());
        }
        let coordinator = if opts.rank == 0 {
            let listener = TcpListener::bind(&opts.rendezvous).map_err(|e| format!("cannot listen on {}: {e}", opts.rendezvous))?;
            let (depth, replicas, timeout) = (opts.depth, opts.replicas, opts.timeout);
            Some(std::thread::spawn(move || coordinate(listener, depth, replicas, timeout)))
        } else {
            None
        };
        let hub_stream = connect_retrying(&opts.rendezvous, opts.timeout)?;
        let my_ip = hub_stream.local_addr().map_err(|e| e.to_string())?.ip();
        let listener = TcpListener::bind((my_ip, 0)).map_err(|e| format!("cannot listen on {my_ip}: {e}"))?;
        let my_addr = listener.local_addr().map_err(|e| e.to_string())?;
        let hub = Link::new(hub_stream)?;
        hub.send(Frame { kind: HELLO, a: opts.rank as u64, text: vec![opts.pipeline.clone(), my_addr.to_string()], ..Frame::default() }, "coordinator")?;
        let table = hub.recv("coordinator", opts.timeout)?;
        if table.kind != TABLE || table.text.len() != world {
            return Err("the coordinator sent no address table".into());
        }
        let (stage, replica) = ((opts.rank % opts.depth) as u32, opts.rank / opts.depth);
        let deadline = Instant::now() + opts.timeout;
        let next = if (stage as usize) + 1 < opts.depth {
            let s = connect_retrying(&table.text[opts.rank + 1], opts.timeout)?;
            let link = Link::new(s)?;
            link.send(Frame { kind: NEIGHBOUR, a: opts.rank as u64, text: opts.send_names.clone(), ..Frame::default() }, "next stage")?;
            let ack = link.recv("next stage", opts.timeout)?;
            if ack.kind != NEIGHBOUR {
                return Err("the next stage did not acknowledge".into());
            }
            Some(link)
        } else {
            None
        };
        let prev = if stage > 0 {
            let link = Link::new(accept_until(&listener, deadline, "previous stage")?)?;
            let hello = link.recv("previous stage", opts.timeout)?;
            if hello.kind != NEIGHBOUR || hello.a as usize != opts.rank - 1 {
                return Err(format!("expected rank {} as the previous stage", opts.rank - 1));
            }
            if hello.text != opts.recv_names {
                let msg = format!("stage {} sends {:?} but stage {stage} receives {:?}", stage - 1, hello.text, opts.recv_names);
                let _ = link.send(Frame::error(msg.clone()), "previous stage");
                return Err(msg);
            }
            link.send(Frame { kind: NEIGHBOUR, ..Frame::default() }, "previous stage")?;
            Some(link)
        } else {
            None
        };
        Ok(Tcp { opts, stage, replica, prev, next, hub: Some(hub), seq: HashMap::new(), coordinator })
    }

    fn reduce(&mut self, group: u64, value: f64, tensors: &[(String, Tensor)]) -> Result<Frame, String> {
        let seq = self.seq.entry(group).or_insert(0);
        let mut f = Frame::with_tensors(REDUCE, group, *seq, tensors)?;
        *seq += 1;
        f.value = value;
        let hub = self.hub.as_ref().ok_or("not connected to the coordinator")?;
        hub.send(f, "coordinator")?;
        let r = hub.recv("coordinator (a reduction's result)", self.opts.idle_timeout)?;
        if r.kind != RESULT || r.a != group {
            return Err("unexpected reply from the coordinator".into());
        }
        Ok(r)
    }

    fn reduce_tensors(&mut self, group: u64, tensors: Vec<Tensor>) -> Result<Vec<Tensor>, String> {
        let named: Named = tensors.into_iter().enumerate().map(|(i, t)| (i.to_string(), t)).collect();
        let r = self.reduce(group, 0.0, &named)?;
        Ok(r.tensors()?.into_iter().map(|(_, t)| t).collect())
    }
}

fn expect(f: Frame, kind: u8, mb: u64, who: &str) -> Result<Named, String> {
    if f.kind != kind || f.a != mb {
        return Err(format!("expected microbatch {mb} from the {who}, got frame kind {} for {}", f.kind, f.a));
    }
    f.tensors()
}

impl Transport for Tcp {
    fn send_forward(&mut self, mb: u64, tensors: Named) -> Result<(), String> {
        let link = self.next.as_ref().ok_or("no next neighbour")?;
        link.send(Frame::with_tensors(FORWARD, mb, 0, &tensors)?, "next stage")
    }
    fn recv_forward(&mut self, mb: u64) -> Result<Named, String> {
        let link = self.prev.as_ref().ok_or("no previous neighbour")?;
        expect(link.recv(&format!("previous stage (microbatch {mb}'s activations)"), self.opts.idle_timeout)?, FORWARD, mb, "previous stage")
    }
    fn send_backward(&mut self, mb: u64, grads: Named) -> Result<(), String> {
        let link = self.prev.as_ref().ok_or("no previous neighbour")?;
        link.send(Frame::with_tensors(BACKWARD, mb, 0, &grads)?, "previous stage")
    }
    fn recv_backward(&mut self, mb: u64) -> Result<Named, String> {
        let link = self.next.as_ref().ok_or("no next neighbour")?;
        expect(link.recv(&format!("next stage (microbatch {mb}'s gradients)"), self.opts.idle_timeout)?, BACKWARD, mb, "next stage")
    }
    fn all_reduce_sum(&mut self, x: f64) -> Result<f64, String> {
        Ok(self.reduce(group_everyone(), x, &[])?.value)
    }
    fn all_reduce_replicas(&mut self, tensors: Vec<Tensor>) -> Result<Vec<Tensor>, String> {
        if self.opts.replicas == 1 {
            return Ok(tensors);
        }
        self.reduce_tensors(group_replicas(self.stage), tensors)
    }
    fn all_reduce_tied(&mut self, stages: &[u32], tensors: Vec<Tensor>) -> Result<Vec<Tensor>, String> {
        self.reduce_tensors(group_tied(self.replica, stages), tensors)
    }
    fn abort(&mut self) {
        let Some(hub) = &self.hub else { return };
        let _ = hub.send(Frame::error(format!("rank {} (stage {}) failed", self.opts.rank, self.stage)), "coordinator");
    }
}

/// Rank 0's coordinator: registration, then reductions until every worker has gone.
fn coordinate(listener: TcpListener, depth: usize, replicas: usize, timeout: Duration) {
    let world = depth * replicas;
    let deadline = Instant::now() + timeout;
    let (all_tx, all_rx) = mpsc::channel::<(usize, Option<Frame>)>();
    let mut writers: Vec<Option<Sender<Frame>>> = (0..world).map(|_| None).collect();
    let mut hellos: Vec<Option<(String, String)>> = (0..world).map(|_| None).collect();
    let broadcast = |writers: &[Option<Sender<Frame>>], f: &dyn Fn() -> Frame| {
        for w in writers.iter().flatten() {
            let _ = w.send(f());
        }
    };
    for _ in 0..world {
        let stream = match accept_until(&listener, deadline, "worker") {
            Ok(s) => s,
            Err(e) => {
                broadcast(&writers, &|| Frame::error(format!("coordinator: {e}: {} of {world} workers registered", hellos.iter().flatten().count())));
                return;
            }
        };
        let Ok(link) = Link::new(stream) else { continue };
        let hello = match link.rx.recv_timeout(timeout) {
            Ok(f) if f.kind == HELLO && f.text.len() == 2 => f,
            _ => continue,
        };
        let rank = hello.a as usize;
        if rank >= world || hellos[rank].is_some() {
                let _ = link.send(Frame::error(format!("coordinator: rank {rank} is out of range or taken (world {world})")), "worker");
            continue;
        }
        hellos[rank] = Some((hello.text[0].clone(), hello.text[1].clone()));
        writers[rank] = link.sender();
        let tx = all_tx.clone();
        std::thread::spawn(move || {
            while let Ok(f) = link.rx.recv() {
                if tx.send((rank, Some(f))).is_err() {
                    return;
                }
            }
            let _ = tx.send((rank, None));
        });
    }
    let ids: Vec<&String> = hellos.iter().flatten().map(|(id, _)| id).collect();
    if let Some(bad) = hellos.iter().position(|h| h.as_ref().map(|(id, _)| id) != ids.first().copied()) {
        let (r0, rb) = (ids.first().map(|s| s.as_str()).unwrap_or(""), hellos[bad].as_ref().map(|(id, _)| id.as_str()).unwrap_or(""));
        broadcast(&writers, &|| Frame::error(format!("rank {bad} runs a stage of another compile (pipeline id {rb:?}, rank 0 has {r0:?})")));
        return;
    }
    let table: Vec<String> = hellos.iter().flatten().map(|(_, a)| a.clone()).collect();
    broadcast(&writers, &|| Frame { kind: TABLE, text: table.clone(), ..Frame::default() });
    drop(all_tx);
    let mut pending: HashMap<(u64, u64), HashMap<usize, Frame>> = HashMap::new();
    let mut gone = 0;
    for (rank, frame) in all_rx {
        let Some(f) = frame else {
            gone += 1;
            if gone == world {
                return;
            }
            continue;
        };
        if f.kind == ERROR {
            let msg = f.text.first().cloned().unwrap_or_default();
            broadcast(&writers, &|| Frame::error(msg.clone()));
            return;
        }
        if f.kind != REDUCE {
            continue;
        }
        let key = (f.a, f.b);
        let group = members(f.a, depth, replicas);
        let parts = pending.entry(key).or_default();
        parts.insert(rank, f);
        if parts.len() < group.len() {
            continue;
        }
        let parts = pending.remove(&key).unwrap_or_default();
        match combine(&group, parts) {
            Ok(result) => {
                for r in &group {
                    if let Some(w) = &writers[*r] {
                        let _ = w.send(Frame { kind: RESULT, a: key.0, b: key.1, value: result.value, tensors: result.tensors.clone(), ..Frame::default() });
                    }
                }
            }
            Err(e) => {
                broadcast(&writers, &|| Frame::error(format!("coordinator: reduction: {e}")));
                return;
            }
        }
    }
}

/// Sums the contributions of `group` in rank order.
fn combine(group: &[usize], mut parts: HashMap<usize, Frame>) -> Result<Frame, String> {
    let mut value = 0.0;
    let mut sums: Option<Vec<Tensor>> = None;
    let mut names = Vec::new();
    for r in group {
        let f = parts.remove(r).ok_or_else(|| format!("rank {r} missing"))?;
        value += f.value;
        let ts = f.tensors()?;
        names = ts.iter().map(|(n, _)| n.clone()).collect();
        let ts: Vec<Tensor> = ts.into_iter().map(|(_, t)| t).collect();
        sums = Some(match sums {
            None => ts,
            Some(acc) => {
                if acc.len() != ts.len() {
                    return Err(format!("rank {r} contributed {} tensors, others {}", ts.len(), acc.len()));
                }
                super::transport::add_lists(&acc, &ts).map_err(|e| format!("rank {r}: {e}"))?
            }
        });
    }
    let named: Named = names.into_iter().zip(sums.unwrap_or_default()).collect();
    let mut f = Frame::with_tensors(RESULT, 0, 0, &named)?;
    f.value = value;
    Ok(f)
}
