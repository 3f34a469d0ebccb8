//! Values kernels read on the host: shapes, axes, pads, repeats, bounds and scalar
//! operands. On a GPU each read of a device tensor is a device→host copy that stalls the
//! stream, so the executor gives a kernel, for each input whose value was known before the
//! step (a stored constant, or a value folded from constants and static shapes when the
//! program was specialised), a host copy of it; the kernel reads the copy. Reads of any
//! other tensor are real synchronisations and are counted per thread ([`host_reads`]), so
//! a test can require that a specialised training step makes none.

use std::cell::{Cell, RefCell};

use tch::{Kind, Tensor};

use super::util::R;

thread_local! {
    /// The host copies of the inputs of the kernel now running, by the address of the
    /// input tensor the kernel was given.
    static COPIES: RefCell<Vec<(usize, Tensor)>> = const { RefCell::new(Vec::new()) };
    /// Reads of tensors that had no host copy, on this thread.
    static READS: Cell<u64> = const { Cell::new(0) };
}

/// Reads of values that had no host copy made by kernels on this thread so far: each is a
/// device→host synchronisation on a GPU.
pub fn host_reads() -> u64 {
    READS.with(Cell::get)
}

/// Runs `f` (a kernel over `inputs`) with `copies[i]` as the host copy of `inputs[i]`.
pub(crate) fn with_host_copies<T>(inputs: &[Option<&Tensor>], copies: &[Option<&Tensor>], f: impl FnOnce() -> T) -> T {
    let pairs: Vec<(usize, Tensor)> = inputs
        .iter()
        .zip(copies)
        .filter_map(|(t, c)| Some((address(t.as_ref()?), c.as_ref()?.shallow_clone())))
        .collect();
    if pairs.is_empty() {
        return f();
    }
    let _scope = Scope(COPIES.with(|c| std::mem::replace(&mut *c.borrow_mut(), pairs)));
    f()
}

/// Puts back the copies of the enclosing call when a kernel ends, even by a panic (a
/// stale address could otherwise match a later tensor).
struct Scope(Vec<(usize, Tensor)>);

impl Drop for Scope {
    fn drop(&mut self) {
        let previous = std::mem::take(&mut self.0);
        COPIES.with(|c| *c.borrow_mut() = previous);
    }
}

fn address(t: &Tensor) -> usize {
    t as *const Tensor as usize
}

/// `t`'s values on the host: its host copy when the executor gave one, otherwise a copy
/// from its device, counted.
pub(crate) fn on_host(t: &Tensor) -> R<Tensor> {
    let at = address(t);
    if let Some(copy) = COPIES.with(|c| c.borrow().iter().find(|(a, _)| *a == at).map(|(_, t)| t.shallow_clone())) {
        return Ok(copy);
    }
    read_to_host(t)
}

/// A counted device→host copy of `t`.
pub(crate) fn read_to_host(t: &Tensor) -> R<Tensor> {
    READS.with(|r| r.set(r.get() + 1));
    Ok(t.f_to(tch::Device::Cpu)?)
}

/// A stand-in for an input a kernel reads only on the host ([`pipewright_ops::Op::reads_on_host`]):
/// `t`'s shape and type on `device` with no values of its own (one broadcast element). The
/// element is one no shape, axis, count or bound takes (NaN for floats), so a kernel that
/// computed with the stand-in instead of reading the host copy fails or gives NaN, which
/// the backend suite would show.
pub fn stand_in(t: &Tensor, device: tch::Device) -> Result<Tensor, tch::TchError> {
    let kind = t.kind();
    let one = match kind {
        Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16 => Tensor::f_full([] as [i64; 0], f64::NAN, (kind, device))?,
        Kind::Bool => Tensor::f_full([] as [i64; 0], 1i64, (kind, device))?,
        Kind::Int | Kind::Int64 => Tensor::f_full([] as [i64; 0], -(1i64 << 30) - 7, (kind, device))?,
        _ => Tensor::f_full([] as [i64; 0], -77i64, (kind, device))?,
    };
    one.f_expand(t.size(), false)
}
