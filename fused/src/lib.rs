//! libtorch's multi-tensor optimizer kernels, which tch does not bind: the fused Adam,
//! AdamW and SGD updates that PyTorch's `fused=True` optimizers run, and a multi-tensor
//! copy. Each call updates a whole list of tensors in one operation, with its
//! hyperparameters as kernel arguments: no host scalar is uploaded per weight and, on a
//! GPU, a stage's whole update is a handful of launches instead of about ten per weight.
//!
//! All tensors of one call must share a device and a floating type (group them first).
//! The C++ side (`src/fused.cpp`) is compiled against the libtorch that torch-sys links.

use std::ffi::{c_char, c_int, CStr};

use tch::{TchError, Tensor};
use torch_sys::C_tensor;

extern "C" {
    fn pw_foreach_copy(src: *const *mut C_tensor, n: i64, out: *mut *mut C_tensor) -> *mut c_char;
    fn pw_fused_adam(
        params: *const *mut C_tensor,
        grads: *const *mut C_tensor,
        exp_avgs: *const *mut C_tensor,
        exp_avg_sqs: *const *mut C_tensor,
        step: *mut C_tensor,
        n: i64,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        decoupled: c_int,
    ) -> *mut c_char;
    fn pw_fused_sgd(params: *const *mut C_tensor, grads: *const *mut C_tensor, buffers: *const *mut C_tensor, n: i64, lr: f64, momentum: f64, weight_decay: f64, first_step: c_int) -> *mut c_char;
}

/// Adam's hyperparameters for one step. `decoupled`: AdamW (`w -= lr*wd*w`) rather than
/// L2 decay folded into the gradient.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Adam {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    pub decoupled: bool,
}

/// SGD's hyperparameters for one step (no dampening, not Nesterov).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sgd {
    pub lr: f64,
    pub momentum: f64,
    pub weight_decay: f64,
}

/// New copies of `ts`, in one multi-tensor operation.
pub fn copy_all(ts: &[Tensor]) -> Result<Vec<Tensor>, TchError> {
    // libtorch's multi-tensor ops refuse an empty list (a stage without weights).
    if ts.is_empty() {
        return Ok(Vec::new());
    }
    let src = pointers(ts);
    let mut out = vec![std::ptr::null_mut(); ts.len()];
    // SAFETY: `src` holds live tensors; on success the shim fills every `out[i]` with a
    // new tensor whose ownership passes to us.
    check(unsafe { pw_foreach_copy(src.as_ptr(), ts.len() as i64, out.as_mut_ptr()) })?;
    // SAFETY: each pointer is a fresh `at::Tensor*` owned by nobody else.
    Ok(out.into_iter().map(|p| unsafe { Tensor::from_ptr(p) }).collect())
}

/// One Adam/AdamW step in place on `params` and the moments `exp_avgs`, `exp_avg_sqs`
/// (zeros before the first step). `step` is a 0-d float tensor on the tensors' device
/// holding this step's number, counted from 1 (it sets the bias corrections).
pub fn adam_(params: &mut [Tensor], grads: &[Tensor], exp_avgs: &mut [Tensor], exp_avg_sqs: &mut [Tensor], step: &Tensor, hp: Adam) -> Result<(), TchError> {
    same_lengths(params.len(), &[grads.len(), exp_avgs.len(), exp_avg_sqs.len()])?;
    if params.is_empty() {
        return Ok(());
    }
    let (p, g, m, v) = (pointers(params), pointers(grads), pointers(exp_avgs), pointers(exp_avg_sqs));
    // SAFETY: all lists hold `params.len()` live tensors; the shim only borrows them.
    check(unsafe {
        pw_fused_adam(
            p.as_ptr(),
            g.as_ptr(),
            m.as_ptr(),
            v.as_ptr(),
            step.as_ptr() as *mut C_tensor,
            params.len() as i64,
            hp.lr,
            hp.beta1,
            hp.beta2,
            hp.weight_decay,
            hp.eps,
            c_int::from(hp.decoupled),
        )
    })
}

/// One SGD step in place on `params` and, with momentum, on `buffers` (one per weight;
/// with `first_step` they are overwritten with the decayed gradient, as PyTorch starts
/// its momentum). Without momentum `buffers` is ignored and may be empty.
pub fn sgd_(params: &mut [Tensor], grads: &[Tensor], buffers: &mut [Tensor], hp: Sgd, first_step: bool) -> Result<(), TchError> {
    let wanted = if hp.momentum != 0.0 { vec![grads.len(), buffers.len()] } else { vec![grads.len()] };
    same_lengths(params.len(), &wanted)?;
    if params.is_empty() {
        return Ok(());
    }
    let (p, g, b) = (pointers(params), pointers(grads), pointers(buffers));
    // SAFETY: as in `adam_`; `b` is read only with momentum, when it has the length.
    check(unsafe { pw_fused_sgd(p.as_ptr(), g.as_ptr(), b.as_ptr(), params.len() as i64, hp.lr, hp.momentum, hp.weight_decay, c_int::from(first_step)) })
}

fn pointers(ts: &[Tensor]) -> Vec<*mut C_tensor> {
    ts.iter().map(|t| t.as_ptr() as *mut C_tensor).collect()
}

fn same_lengths(n: usize, others: &[usize]) -> Result<(), TchError> {
    match others.iter().find(|&&k| k != n) {
        Some(k) => Err(TchError::Torch(format!("fused optimizer step: {n} weights but a list of {k}"))),
        None => Ok(()),
    }
}

/// The shim's error message as a `TchError` (and the message freed).
fn check(err: *mut c_char) -> Result<(), TchError> {
    if err.is_null() {
        return Ok(());
    }
    // SAFETY: a non-null result is a NUL-terminated string from `malloc`.
    let msg = unsafe { CStr::from_ptr(err) }.to_string_lossy().into_owned();
    unsafe { libc::free(err.cast()) };
    Err(TchError::Torch(msg))
}
