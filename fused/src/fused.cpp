// The C side of pipewright-fused: libtorch's multi-tensor optimizer kernels (the ones
// PyTorch's `fused=True` optimizers call), over tensors that tch owns.
//
// Tensors arrive as `at::Tensor*` (tch's `C_tensor`). Every entry point catches C++
// exceptions and returns the message (malloc'd, freed by the caller with `free`), or null.
#include <ATen/core/Tensor.h>
#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/_fused_adam.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/_fused_sgd.h>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <vector>

namespace {

std::vector<at::Tensor> list(at::Tensor **ts, int64_t n) {
    std::vector<at::Tensor> out;
    out.reserve(n);
    for (int64_t i = 0; i < n; ++i) out.push_back(*ts[i]);
    return out;
}

char *message(const char *what) {
    char *copy = static_cast<char *>(std::malloc(std::strlen(what) + 1));
    if (copy) std::strcpy(copy, what);
    return copy;
}

template <typename F> char *guarded(F f) {
    try {
        f();
        return nullptr;
    } catch (const std::exception &e) {
        return message(e.what());
    } catch (...) {
        return message("unknown C++ exception");
    }
}

} // namespace

extern "C" {

// Copies of `n` tensors in one multi-tensor operation (x * 1 is exact, NaN included);
// `out[i]` receives a new `at::Tensor*` that the caller owns.
char *pw_foreach_copy(at::Tensor **src, int64_t n, at::Tensor **out) {
    return guarded([&] {
        auto copies = at::_foreach_mul(list(src, n), at::Scalar(1.0));
        for (int64_t i = 0; i < n; ++i) out[i] = new at::Tensor(std::move(copies[i]));
    });
}

// Adam (L2 decay folded into the gradient) or, with `decoupled`, AdamW, in place on
// params, exp_avgs and exp_avg_sqs. `step` holds the step number (already counted for
// this step) on the tensors' device; every parameter reads the same one.
char *pw_fused_adam(at::Tensor **params, at::Tensor **grads, at::Tensor **exp_avgs, at::Tensor **exp_avg_sqs,
                    at::Tensor *step, int64_t n, double lr, double beta1, double beta2, double weight_decay,
                    double eps, int decoupled) {
    return guarded([&] {
        std::vector<at::Tensor> steps(n, *step);
        auto p = list(params, n), g = list(grads, n), m = list(exp_avgs, n), v = list(exp_avg_sqs, n);
        if (decoupled)
            at::_fused_adamw_(p, g, m, v, {}, steps, lr, beta1, beta2, weight_decay, eps, false, false);
        else
            at::_fused_adam_(p, g, m, v, {}, steps, lr, beta1, beta2, weight_decay, eps, false, false);
    });
}

// SGD with optional momentum (no dampening, not Nesterov) and L2 weight decay, in place
// on params and, when `momentum` is nonzero, on the `n` momentum buffers
// (`first_step`: they are set to the decayed gradient rather than updated).
char *pw_fused_sgd(at::Tensor **params, at::Tensor **grads, at::Tensor **buffers, int64_t n, double lr,
                   double momentum, double weight_decay, int first_step) {
    return guarded([&] {
        auto p = list(params, n), g = list(grads, n);
        auto b = momentum != 0.0 ? list(buffers, n) : std::vector<at::Tensor>{};
        at::_fused_sgd_(p, g, b, weight_decay, momentum, lr, 0.0, false, false, first_step != 0);
    });
}

} // extern "C"
