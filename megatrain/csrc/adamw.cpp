// One-pass host AdamW: reads p, m, v (fp32) and the gradient (bf16 or fp32) once, writes p, m, v once
// (26 B/param with a bf16 gradient; 28 with p's bf16 shadow written in the same pass), multithreaded with
// OpenMP, in blocks of 4096 elements that stay in cache.
//
// Arithmetic: torch's fused CPU AdamW (aten/src/ATen/native/cpu/FusedAdamKernel.cpp), operation by operation:
// constants computed in double and rounded once to float; p *= 1 - lr*wd; m = fma(1-b1, g - m, m) (torch's
// lerp for a weight < 0.5); v = v*b2 + (1-b2)*g*g; denom = sqrt(v)/sqrt(bc2) + eps; p -= step_size*m/denom.
// Built with -ffp-contract=off (megatrain/kernels.py) so that nothing else is fused: every operation is
// IEEE-rounded as written, and the result is the same bits on every machine, whatever its vector width.
//
// Speculation (megatrain/host_adamw.py): an update applied before the clip coefficient is known must be
// undoable. p and m undo to within an ulp or so; v does not where the new gradient dwarfs it: v_new =
// b2*v_old + (1-b2)*g^2 keeps only the bits of v_old above ulp(v_new), the rest is gone. An element whose
// v_old is 1/1000 of v_new came back ~1e-4 wrong, and its later steps, scaled by 1/sqrt(v), carried that on
// (embedding rows that reappear, a loss spike, the first steps of training). So the speculative pass leaves
// every such "fragile" element (v_new > 64 v_old, v_old == 0 included) as it is, in the same vectorised pass
// that updates the others; then each fragile element's exact m and v go to a side list and it is updated on
// its own (same operations, same bits), and the undo puts the saved m and v back. Every other element has
// v_old >= v_new/64, and its undo restores v to ~2^-17 relative, p and m to ~an ulp. The list is capped (a
// share of it per thread, set by the caller); a block whose fragile elements do not fit keeps them as they
// were and is flagged "deferred": they are updated from their untouched state once the coefficient is known.
// Which elements of a deferred block were left: exactly those still fragile in the current state (an updated
// element has v >= (1-b2) g^2, so it never is).
#include <torch/extension.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <omp.h>

#include <tuple>
#include <vector>

namespace {

constexpr int64_t kBlock = 4096;       // elements per block: the unit of work and of deferral
constexpr float kFragile = 64.0f;      // v_new > kFragile * v_old: the undo could not restore v closely

struct Consts {
  // float: exactly the numbers the update uses (as torch's fused kernel rounds them)
  float w1, b2, w2, step_size, bc2_sqrt, decay, eps, frag_k;
  double b1d;  // the undo's divisor for m (b1 itself; m's update is a lerp with weight w1 = 1 - b1)
  bool first;  // step count 1: the moments were zeros before this update

  Consts(double lr, double b1, double b2_, double eps_, double wd, double step) {
    w1 = (float)(1.0 - b1);
    b2 = (float)b2_;
    w2 = (float)(1.0 - b2_);
    step_size = (float)(lr / (1.0 - std::pow(b1, step)));
    bc2_sqrt = (float)std::sqrt(1.0 - std::pow(b2_, step));
    decay = (float)(1.0 - lr * wd);
    eps = (float)eps_;
    frag_k = (float)((kFragile - b2_) / (1.0 - b2_));
    b1d = 1.0 - (double)w1;
    first = step <= 1.0;
  }
};

// The gradient of one block as fp32 (bf16 -> fp32 is exact: the high half of the bits), times nothing.
struct Grad {
  const uint16_t* g16 = nullptr;
  const float* g32 = nullptr;
  explicit Grad(const torch::Tensor& g) {
    if (g.scalar_type() == torch::kBFloat16) {
      g16 = reinterpret_cast<const uint16_t*>(g.data_ptr());
    } else {
      TORCH_CHECK(g.scalar_type() == torch::kFloat, "gradient must be bf16 or fp32");
      g32 = g.data_ptr<float>();
    }
  }
  void load(float* out, int64_t lo, int64_t len) const {
    if (g16 != nullptr) {
      uint32_t* o = reinterpret_cast<uint32_t*>(out);
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) o[i] = ((uint32_t)g16[lo + i]) << 16;
    } else {
      std::memcpy(out, g32 + lo, len * sizeof(float));
    }
  }
};

inline void block_step(float* __restrict p, float* __restrict m, float* __restrict v, const float* __restrict g,
                       int64_t len, float coef, const Consts& c) {
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) {
    const float gi = g[i] * coef;
    const float mi = std::fma(c.w1, gi - m[i], m[i]);
    const float vi = v[i] * c.b2 + c.w2 * gi * gi;
    const float denom = std::sqrt(vi) / c.bc2_sqrt + c.eps;
    p[i] = p[i] * c.decay - c.step_size * mi / denom;
    m[i] = mi;
    v[i] = vi;
  }
}

// Whether a coefficient-1 update of this element would lose v_old beyond what the undo can restore:
// v_new = b2 v_old + (1-b2) g^2 > 64 v_old, written as (1-b2) g^2 > (64-b2) v_old (c.frag_k = (64-b2)/(1-b2)),
// two multiplies and a compare. v_old == 0 with g != 0 counts too: exact zeros come back as zeros.
inline bool fragile(float v_old, float g, const Consts& c) { return g * g > c.frag_k * v_old; }

// How many elements of a block are fragile (vectorised: a float count, the lanes' own width; exact below 2^24).
inline int64_t count_fragile(const float* __restrict v, const float* __restrict g, int64_t len, const Consts& c) {
  float count = 0.0f;
#pragma omp simd reduction(+ : count)
  for (int64_t i = 0; i < len; ++i) count += fragile(v[i], g[i], c) ? 1.0f : 0.0f;
  return (int64_t)count;
}

// a if c else b, bit for bit, as a mask (GCC does not vectorise the loop below with a conditional select).
inline float pick(bool c, float a, float b) {
  uint32_t ia, ib;
  std::memcpy(&ia, &a, 4);
  std::memcpy(&ib, &b, 4);
  const uint32_t mask = 0u - (uint32_t)c, r = (ia & mask) | (ib & ~mask);
  float out;
  std::memcpy(&out, &r, 4);
  return out;
}

// block_step on the elements ``fragile`` selects (``only_fragile``) or on all the others (not), the rest
// left as they are (a blend in the same vectorised pass); returns how many were fragile. Same operations as
// block_step: the same bits.
inline int64_t block_step_masked(float* __restrict p, float* __restrict m, float* __restrict v,
                                 const float* __restrict g, int64_t len, float coef, bool only_fragile,
                                 const Consts& c) {
  int count = 0;
#pragma omp simd reduction(+ : count)
  for (int64_t i = 0; i < len; ++i) {
    const float po = p[i], mo = m[i], vo = v[i], gi = g[i] * coef;
    const bool f = fragile(vo, g[i], c);
    const bool apply = f == only_fragile;
    const float mi = std::fma(c.w1, gi - mo, mo);
    const float vi = vo * c.b2 + c.w2 * gi * gi;
    const float denom = std::sqrt(vi) / c.bc2_sqrt + c.eps;
    const float pi = po * c.decay - c.step_size * mi / denom;
    p[i] = pick(apply, pi, po);
    m[i] = pick(apply, mi, mo);
    v[i] = pick(apply, vi, vo);
    count += f;
  }
  return count;
}

// Inverts block_step with coefficient 1 in float64, with the same float constants. At step 1 the moments
// were zeros. (Fragile elements are then overwritten with their saved m and v by the caller.)
inline void block_undo(float* __restrict p, float* __restrict m, float* __restrict v, const float* __restrict g,
                       int64_t len, const Consts& c) {
  const double ss = c.step_size, bc2s = c.bc2_sqrt, eps = c.eps, decay = c.decay, w1 = c.w1, b2 = c.b2,
               w2 = c.w2, b1 = c.b1d;
  if (c.first) {
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) {
      const double pd = p[i], md = m[i], vd = v[i];
      p[i] = (float)((pd + ss * md / (std::sqrt(vd) / bc2s + eps)) / decay);
      m[i] = 0.0f;
      v[i] = 0.0f;
    }
    return;
  }
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) {
    const double gi = g[i], pd = p[i], md = m[i], vd = v[i];
    p[i] = (float)((pd + ss * md / (std::sqrt(vd) / bc2s + eps)) / decay);
    m[i] = (float)((md - w1 * gi) / b1);
    const float vo = (float)((vd - w2 * gi * gi) / b2);
    v[i] = vo > 0.0f ? vo : 0.0f;  // (a clamp in float: GCC does not vectorise the loop with one in double)
  }
}

// block_undo in a deferred block: its still-fragile elements were never updated and stay as they are.
inline void block_undo_deferred(float* p, float* m, float* v, const float* g, int64_t len, const Consts& c) {
  for (int64_t i0 = 0; i0 < len; i0 += 64) {
    const int64_t n = std::min<int64_t>(64, len - i0);
    if (count_fragile(v + i0, g + i0, n, c) == 0) {
      block_undo(p + i0, m + i0, v + i0, g + i0, n, c);
      continue;
    }
    for (int64_t i = i0; i < i0 + n; ++i)
      if (!fragile(v[i], g[i], c)) block_undo(p + i, m + i, v + i, g + i, 1, c);
  }
}

struct Views {
  float *P, *M, *V;
  int64_t n;
  Views(torch::Tensor& p, const torch::Tensor& g, torch::Tensor& m, torch::Tensor& v) {
    TORCH_CHECK(p.is_contiguous() && g.is_contiguous() && m.is_contiguous() && v.is_contiguous(), "contiguous");
    TORCH_CHECK(p.scalar_type() == torch::kFloat && m.scalar_type() == torch::kFloat &&
                    v.scalar_type() == torch::kFloat, "p, m, v must be fp32");
    n = p.numel();
    TORCH_CHECK(g.numel() == n && m.numel() == n && v.numel() == n, "sizes differ");
    P = p.data_ptr<float>();
    M = m.data_ptr<float>();
    V = v.data_ptr<float>();
  }
  int64_t blocks() const { return (n + kBlock - 1) / kBlock; }
};

// The bf16 shadow of p (the weights that cross the link as bf16), or nullptr when ``shadow`` is empty.
uint16_t* shadow_of(const torch::Tensor& shadow, int64_t n) {
  if (shadow.numel() == 0) return nullptr;
  TORCH_CHECK(shadow.scalar_type() == torch::kBFloat16 && shadow.is_contiguous() && shadow.numel() == n,
              "shadow: a contiguous bf16 tensor of p's size");
  return reinterpret_cast<uint16_t*>(shadow.data_ptr<at::BFloat16>());
}

// fp32 -> bf16 as torch's Tensor.copy_ rounds (c10::round_to_nearest_even): NaN -> 0x7FC0, else round to
// nearest, ties to even. Written over a block just updated, while it is still in cache: the shadow costs its
// 2 B/param of writes, not a second pass that reads the master back from memory.
inline void block_shadow(const float* __restrict p, uint16_t* __restrict out, int64_t len) {
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) {
    uint32_t u;
    std::memcpy(&u, p + i, sizeof(u));
    const uint16_t r = (uint16_t)((u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16);
    out[i] = std::isnan(p[i]) ? (uint16_t)0x7FC0 : r;
  }
}

uint8_t* flags_of(const torch::Tensor& deferred, int64_t nblocks) {
  if (deferred.numel() == 0) return nullptr;
  TORCH_CHECK(deferred.scalar_type() == torch::kUInt8 && deferred.is_contiguous() && deferred.numel() == nblocks,
              "deferred: one uint8 per block of ", kBlock, " elements");
  return deferred.data_ptr<uint8_t>();
}

int nthreads(int64_t threads) { return threads > 0 ? (int)threads : omp_get_max_threads(); }

}  // namespace

// ``shadow`` (empty: none): p's bf16 copy, written block by block as p is updated.
void adamw_step(torch::Tensor p, torch::Tensor g, torch::Tensor m, torch::Tensor v, double coef, double lr,
                double b1, double b2, double eps, double wd, double step, int64_t threads, torch::Tensor shadow) {
  Views t(p, g, m, v);
  const Grad grad(g);
  const Consts c(lr, b1, b2, eps, wd, step);
  const float cf = (float)coef;
  const int64_t nb = t.blocks();
  uint16_t* const S = shadow_of(shadow, t.n);
#pragma omp parallel for schedule(static) num_threads(nthreads(threads))
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = b * kBlock, len = std::min(kBlock, t.n - lo);
    float gbuf[kBlock];
    grad.load(gbuf, lo, len);
    block_step(t.P + lo, t.M + lo, t.V + lo, gbuf, len, cf, c);
    if (S != nullptr) block_shadow(t.P + lo, S + lo, len);
  }
}

// A speculative (coefficient-1) update. Saves (index, m_old, v_old) of each fragile element, at most ``cap``
// of them; a block whose fragile elements do not fit is left untouched and flagged in ``deferred``.
// Returns (deferred blocks, indices int32 ascending, saved [k, 2] fp32).
std::tuple<int64_t, torch::Tensor, torch::Tensor> adamw_speculate(
    torch::Tensor p, torch::Tensor g, torch::Tensor m, torch::Tensor v, torch::Tensor deferred, int64_t cap,
    double lr, double b1, double b2, double eps, double wd, double step, int64_t threads) {
  Views t(p, g, m, v);
  TORCH_CHECK(t.n < (int64_t(1) << 31), "a chunk has fewer than 2^31 elements");
  const Grad grad(g);
  const Consts c(lr, b1, b2, eps, wd, step);
  const int64_t nb = t.blocks();
  uint8_t* flags = flags_of(deferred, nb);
  TORCH_CHECK(flags != nullptr, "deferred is required");
  const int nt = nthreads(threads);
  std::vector<std::vector<int32_t>> idx(nt);
  std::vector<std::vector<float>> saved(nt);
  int64_t count = 0;
#pragma omp parallel num_threads(nt) reduction(+ : count)
  {
    // Thread k takes the k-th contiguous range of blocks and its share of ``cap``, first come first served in
    // block order: deterministic for a thread count (no race for the budget), and the lists joined in thread
    // order ascend.
    const int k = omp_get_thread_num(), nk = omp_get_num_threads();
    const int64_t b0 = nb * k / nk, b1 = nb * (k + 1) / nk;
    int64_t room = nb ? cap * (b1 - b0) / nb : 0;
    auto& I = idx[k];
    auto& S = saved[k];
    float gbuf[kBlock];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = b * kBlock, len = std::min(kBlock, t.n - lo);
      grad.load(gbuf, lo, len);
      float *P = t.P + lo, *M = t.M + lo, *V = t.V + lo;
      if (c.first) {  // the moments are zeros: the undo restores them exactly, nothing is fragile
        block_step(P, M, V, gbuf, len, 1.0f, c);
        flags[b] = 0;
        continue;
      }
      const int64_t nf = block_step_masked(P, M, V, gbuf, len, 1.0f, false, c);  // all but the fragile
      flags[b] = nf > room;
      if (nf == 0) continue;
      if (nf > room) {  // deferred: they stay as they are
        ++count;
        continue;
      }
      room -= nf;
      for (int64_t i0 = 0; i0 < len; i0 += 64) {  // find them 64 at a time (vectorised), then one by one
        const int64_t i1 = std::min(i0 + 64, len);
        if (count_fragile(V + i0, gbuf + i0, i1 - i0, c) == 0) continue;
        for (int64_t i = i0; i < i1; ++i) {
          if (fragile(V[i], gbuf[i], c)) {
            I.push_back((int32_t)(lo + i));
            S.push_back(M[i]);
            S.push_back(V[i]);
            block_step(P + i, M + i, V + i, gbuf + i, 1, 1.0f, c);
          }
        }
      }
    }
  }
  int64_t k = 0;
  for (auto& I : idx) k += (int64_t)I.size();
  auto out_idx = torch::empty({k}, torch::kInt32);
  auto out_saved = torch::empty({k, 2}, torch::kFloat);
  int64_t at = 0;
  for (int i = 0; i < nt; ++i) {
    std::memcpy(out_idx.data_ptr<int32_t>() + at, idx[i].data(), idx[i].size() * sizeof(int32_t));
    std::memcpy(out_saved.data_ptr<float>() + 2 * at, saved[i].data(), saved[i].size() * sizeof(float));
    at += (int64_t)idx[i].size();
  }
  return {count, out_idx, out_saved};
}

// Resolves a speculative update once the coefficient is known, block by block in one pass (each block's undo
// and redo happen while it is in cache). Deferred blocks (never updated): updated with ``coef``, or left alone
// when coef < 0 (a skipped step). Updated blocks: when ``undo``, undone (fragile elements from their saved m
// and v: ``idx``/``saved`` from adamw_speculate) and, if coef >= 0, redone with it; otherwise left as they are
// (coefficient 1 was right). Empty ``deferred``/``idx``: nothing deferred/saved.
void adamw_resolve(torch::Tensor p, torch::Tensor g, torch::Tensor m, torch::Tensor v, torch::Tensor deferred,
                   torch::Tensor idx, torch::Tensor saved, double coef, bool undo, double lr, double b1, double b2,
                   double eps, double wd, double step, int64_t threads) {
  Views t(p, g, m, v);
  const Grad grad(g);
  const Consts c(lr, b1, b2, eps, wd, step);
  const int64_t nb = t.blocks();
  const uint8_t* flags = flags_of(deferred, nb);
  const int64_t k = idx.numel();
  TORCH_CHECK(k == 0 || (idx.scalar_type() == torch::kInt32 && idx.is_contiguous() &&
                         saved.scalar_type() == torch::kFloat && saved.is_contiguous() && saved.numel() == 2 * k),
              "idx int32 [k], saved fp32 [k, 2]");
  const int32_t* I = k ? idx.data_ptr<int32_t>() : nullptr;
  const float* S = k ? saved.data_ptr<float>() : nullptr;
  const float cf = (float)coef;
#pragma omp parallel for schedule(static) num_threads(nthreads(threads))
  for (int64_t b = 0; b < nb; ++b) {
    const bool was_deferred = flags != nullptr && flags[b] != 0;
    if (!was_deferred && !undo) continue;  // kept and complete: nothing to do
    const int64_t lo = b * kBlock, len = std::min(kBlock, t.n - lo);
    float gbuf[kBlock];
    grad.load(gbuf, lo, len);
    float *P = t.P + lo, *M = t.M + lo, *V = t.V + lo;
    if (undo) {
      if (was_deferred) {
        block_undo_deferred(P, M, V, gbuf, len, c);
      } else {
        block_undo(P, M, V, gbuf, len, c);
      }
      for (const int32_t* j = std::lower_bound(I, I + k, (int32_t)lo); j < I + k && *j < lo + len; ++j) {
        M[*j - lo] = S[2 * (j - I)];
        V[*j - lo] = S[2 * (j - I) + 1];
      }
      if (coef >= 0.0) block_step(P, M, V, gbuf, len, cf, c);  // every element is at its old state now
    } else {
      block_step_masked(P, M, V, gbuf, len, cf, true, c);  // kept: the deferred (still fragile) elements
    }
  }
}

// All run in the host optimizer's worker thread while the main thread issues the GPU's work: they drop the
// GIL for the whole call (they touch no Python object), or the main thread could not run a line of Python
// until each chunk's update returned, and the next forward would advance at the optimizer's pace.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.attr("BLOCK") = kBlock;
  mod.def("adamw_step", &adamw_step, "one-pass fp32 AdamW with a bf16/fp32 gradient (OpenMP), optionally "
          "writing p's bf16 shadow (an empty tensor: none)",
          py::call_guard<py::gil_scoped_release>());
  mod.def("adamw_speculate", &adamw_speculate, "coefficient-1 AdamW that defers the blocks it could not undo",
          py::call_guard<py::gil_scoped_release>());
  mod.def("adamw_resolve", &adamw_resolve, "undo/redo a speculative update and apply its deferred blocks",
          py::call_guard<py::gil_scoped_release>());
}
