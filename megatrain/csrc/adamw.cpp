// One-pass host AdamW: reads p, m, v (fp32) and the gradient (bf16 or fp32) once, writes p, m, v once
// (26 B/param with a bf16 gradient), multithreaded with OpenMP. The arithmetic follows torch.optim.AdamW
// (decoupled decay, lerp for m, bias corrections, eps added after the sqrt), in fp32.
#include <torch/extension.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <omp.h>

template <typename LoadG>
static void adamw_loop(float* __restrict p, float* __restrict m, float* __restrict v, int64_t n, LoadG load_g,
                       float coef, double lr_d, double b1_d, double b2_d, float eps, double wd, double step,
                       int threads) {
  // Constants in double, then rounded once (as torch's fused kernel does), so that the float64 undo in
  // megatrain/optim.py inverts exactly these numbers.
  const float b2 = (float)b2_d;
  const float w1 = (float)(1.0 - b1_d), w2 = (float)(1.0 - b2_d);
  const float step_size = (float)(lr_d / (1.0 - std::pow(b1_d, step)));
  const float bc2_sqrt = (float)std::sqrt(1.0 - std::pow(b2_d, step));
  const float decay = (float)(1.0 - lr_d * wd);
  // Blocks of 4096 elements per thread iteration; the inner loop is plain and vectorises (no calls).
  const int64_t block = 4096;
  const int64_t nblocks = (n + block - 1) / block;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t lo = b * block, hi = lo + block < n ? lo + block : n;
    float gbuf[block];
    load_g(gbuf, lo, hi);
    const int64_t len = hi - lo;
    float* __restrict pp = p + lo;
    float* __restrict mm = m + lo;
    float* __restrict vv = v + lo;
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) {
      const float g = gbuf[i] * coef;
      const float mi = mm[i] + w1 * (g - mm[i]);
      const float vi = vv[i] * b2 + w2 * g * g;
      const float denom = std::sqrt(vi) / bc2_sqrt + eps;
      pp[i] = pp[i] * decay - step_size * mi / denom;
      mm[i] = mi;
      vv[i] = vi;
    }
  }
}

void adamw_step(torch::Tensor p, torch::Tensor g, torch::Tensor m, torch::Tensor v, double coef, double lr,
                double b1, double b2, double eps, double wd, double step, int64_t threads) {
  TORCH_CHECK(p.is_contiguous() && g.is_contiguous() && m.is_contiguous() && v.is_contiguous(), "contiguous");
  TORCH_CHECK(p.scalar_type() == torch::kFloat && m.scalar_type() == torch::kFloat && v.scalar_type() == torch::kFloat);
  const int64_t n = p.numel();
  TORCH_CHECK(g.numel() == n && m.numel() == n && v.numel() == n, "sizes differ");
  float* P = p.data_ptr<float>();
  float* M = m.data_ptr<float>();
  float* V = v.data_ptr<float>();
  const int nt = threads > 0 ? (int)threads : omp_get_max_threads();
  if (g.scalar_type() == torch::kBFloat16) {
    const uint16_t* G = reinterpret_cast<const uint16_t*>(g.data_ptr());
    adamw_loop(P, M, V, n, [G](float* out, int64_t lo, int64_t hi) {
      uint32_t* o = reinterpret_cast<uint32_t*>(out);
#pragma omp simd
      for (int64_t i = lo; i < hi; ++i) o[i - lo] = ((uint32_t)G[i]) << 16;  // bf16 -> fp32: the high half
    }, (float)coef, lr, b1, b2, (float)eps, wd, step, nt);
  } else {
    TORCH_CHECK(g.scalar_type() == torch::kFloat, "gradient must be bf16 or fp32");
    const float* G = g.data_ptr<float>();
    adamw_loop(P, M, V, n, [G](float* out, int64_t lo, int64_t hi) { std::memcpy(out, G + lo, (hi - lo) * 4); },
               (float)coef, lr, b1, b2, (float)eps, wd, step, nt);
  }
}

// Undo adamw_step (coefficient 1, step count ``step`` after the increment) in float64 and, if redo_coef >= 0,
// redo it with that clip coefficient, in one pass (the rollback of a speculative update). Same algebra as
// megatrain.optim.adamw_undo_: p_mid = p + lr/bc1 * m/(sqrt(v)/sqrt(bc2) + eps), / (1 - lr*wd);
// m = (m - (1-b1) g)/b1; v = (v - (1-b2) g^2)/b2; moments indistinguishable from zero (both below 2^-18 of
// the new ones) are zero; at step 1 the moments were zeros.
void adamw_undo(torch::Tensor p, torch::Tensor g, torch::Tensor m, torch::Tensor v, double redo_coef, double lr,
                double b1, double b2, double eps, double wd, double step, int64_t threads) {
  TORCH_CHECK(p.is_contiguous() && g.is_contiguous() && m.is_contiguous() && v.is_contiguous(), "contiguous");
  const int64_t n = p.numel();
  float* P = p.data_ptr<float>();
  float* M = m.data_ptr<float>();
  float* V = v.data_ptr<float>();
  const bool bf16 = g.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(bf16 || g.scalar_type() == torch::kFloat, "gradient must be bf16 or fp32");
  const uint16_t* G16 = bf16 ? reinterpret_cast<const uint16_t*>(g.data_ptr()) : nullptr;
  const float* G32 = bf16 ? nullptr : g.data_ptr<float>();
  const double bc1 = 1.0 - std::pow(b1, step), bc2s = std::sqrt(1.0 - std::pow(b2, step));
  const double tiny = std::ldexp(1.0, -18);
  const int nt = threads > 0 ? (int)threads : omp_get_max_threads();
#pragma omp parallel for schedule(static) num_threads(nt)
  for (int64_t i = 0; i < n; ++i) {
    double gi;
    if (bf16) {
      uint32_t bits = ((uint32_t)G16[i]) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      gi = f;
    } else {
      gi = G32[i];
    }
    const double pd = P[i], md = M[i], vd = V[i];
    double po = pd + (lr / bc1) * md / (std::sqrt(vd) / bc2s + eps);
    if (wd != 0.0) po /= (1.0 - lr * wd);
    double mo = 0.0, vo = 0.0;
    if (step > 1.0) {
      mo = (md - (1.0 - b1) * gi) / b1;
      vo = (vd - (1.0 - b2) * gi * gi) / b2;
      if (std::fabs(vo) <= vd * tiny && std::fabs(mo) <= std::fabs(md) * tiny) mo = vo = 0.0;
      if (vo < 0.0) vo = 0.0;
    }
    P[i] = (float)po;
    M[i] = (float)mo;
    V[i] = (float)vo;
  }
  if (redo_coef >= 0.0) adamw_step(p, g, m, v, redo_coef, lr, b1, b2, eps, wd, step, threads);
}

// Both run in the host optimizer's worker thread while the main thread issues the GPU's work: they drop the
// GIL for the whole call (they touch no Python object), or the main thread could not run a line of Python
// until each chunk's update returned, and the next forward would advance at the optimizer's pace.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("adamw_step", &adamw_step, "one-pass fp32 AdamW with a bf16/fp32 gradient (OpenMP)",
          py::call_guard<py::gil_scoped_release>());
  mod.def("adamw_undo", &adamw_undo, "undo adamw_step in float64 (and redo it with a clip coefficient)",
          py::call_guard<py::gil_scoped_release>());
}
