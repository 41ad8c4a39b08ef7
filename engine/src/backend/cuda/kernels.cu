// Kernels of the CUDA backend. Compiled by NVRTC with --fmad=false, so every multiply and add
// rounds on its own as it does in the CPU backend's Rust code, and with no headers: bf16 is
// stored as its 16 bits and converted here with the `half` crate's rounding.
//
// Storage types are float and bf16; arithmetic is f32. Each kernel of the model exists as
// `<name>_f32` and `<name>_bf16` (see DEFINE_KERNELS); the optimizer's kernels are f32 only.
// Sums never use atomics: a value is reduced by one thread in a fixed order, or by a fixed tree
// over one block's threads, so every run gives the same bits.

typedef unsigned short bf16;
typedef unsigned int u32;
typedef unsigned long long u64;

// Threads per block of every row-wise kernel; the tree reductions assume this power of two.
#define BLOCK 256

__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ float widen(bf16 x) { return __uint_as_float(((u32)x) << 16); }

template <typename T> __device__ __forceinline__ T narrow(float x);
template <> __device__ __forceinline__ float narrow<float>(float x) { return x; }
// f32 -> bf16, round to nearest even; NaN keeps its high mantissa bits and becomes quiet.
template <> __device__ __forceinline__ bf16 narrow<bf16>(float x) {
    u32 u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x0040u);
    u32 round_bit = 0x00008000u;
    if ((u & round_bit) != 0u && (u & (3u * round_bit - 1u)) != 0u) return (bf16)((u >> 16) + 1u);
    return (bf16)(u >> 16);
}

// The value `x` takes once stored as T.
template <typename T> __device__ __forceinline__ float round_as(float x) { return widen(narrow<T>(x)); }

// e^x exactly as the CPU backend computes it (Cephes' polynomial, branch-free selects).
__device__ __forceinline__ float cpu_exp(float x) {
    const float HI = 88.72284f;
    const float LO = -87.33655f;
    const float LOG2E = 1.44269504088896340736f;
    const float LN2_HI = 0.6933594f;
    const float LN2_LO = -2.1219444e-4f;
    const float ROUND = 12582912.0f;
    float xc = x < LO ? LO : x;
    xc = xc > HI ? HI : xc;
    float shifted = xc * LOG2E + ROUND;
    float n = shifted - ROUND;
    float r = xc - n * LN2_HI - n * LN2_LO;
    float p = 1.9875691e-4f;
    p = p * r + 1.3981999e-3f;
    p = p * r + 8.333452e-3f;
    p = p * r + 4.1665796e-2f;
    p = p * r + 1.6666665e-1f;
    p = p * r + 0.5f;
    float y = p * r * r + r + 1.0f;
    u32 biased = __float_as_uint(shifted) - __float_as_uint(ROUND) + 127u;
    float scale = __uint_as_float(biased << 23);
    u32 result = __float_as_uint(y * scale);
    u32 keep = x >= LO ? 0xffffffffu : 0u;
    u32 nan = x != x ? 0xffffffffu : 0u;
    return __uint_as_float((nan & __float_as_uint(x)) | (~nan & keep & result));
}

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + cpu_exp(-x)); }

// Sum of one value per thread of a BLOCK-thread block, by a fixed tree; every thread gets it.
__device__ float block_sum(float v, float* sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (int s = BLOCK / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
        __syncthreads();
    }
    float r = sh[0];
    __syncthreads();
    return r;
}

// Maximum of one value per thread, as block_sum.
__device__ float block_max(float v, float* sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (int s = BLOCK / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) sh[threadIdx.x] = fmaxf(sh[threadIdx.x], sh[threadIdx.x + s]);
        __syncthreads();
    }
    float r = sh[0];
    __syncthreads();
    return r;
}

__device__ __forceinline__ u64 global_index() { return (u64)blockIdx.x * blockDim.x + threadIdx.x; }

// out[r, :] = table[ids[r], :]
template <typename T>
__device__ void embedding_fwd(const T* table, const u32* ids, T* out, u64 rows, u64 width) {
    u64 i = global_index();
    if (i >= rows * width) return;
    u64 r = i / width, c = i % width;
    out[i] = table[(u64)ids[r] * width + c];
}

// dtable[ids[p], :] += dout[p, :] over the positions p of one distinct id (block), in order.
template <typename T>
__device__ void embedding_bwd(const T* dout, const u32* positions, const u32* starts, const u32* ids,
                              float* dtable, u64 width) {
    u32 b = blockIdx.x;
    u64 id = ids[b];
    for (u64 c = threadIdx.x; c < width; c += blockDim.x) {
        float acc = dtable[id * width + c];
        for (u32 p = starts[b]; p < starts[b + 1]; ++p) acc += widen(dout[(u64)positions[p] * width + c]);
        dtable[id * width + c] = acc;
    }
}

// One row per block: y = w * round(x / rms(x)); rinv = 1 / rms.
template <typename T>
__device__ void rmsnorm_fwd(const T* x, const T* w, T* y, float* rinv, u32 h, float eps) {
    __shared__ float sh[BLOCK];
    u64 row = blockIdx.x;
    const T* xr = x + row * h;
    float ss = 0.0f;
    for (u32 j = threadIdx.x; j < h; j += BLOCK) {
        float v = widen(xr[j]);
        ss += v * v;
    }
    ss = block_sum(ss, sh);
    float r = 1.0f / sqrtf(ss / (float)h + eps);
    for (u32 j = threadIdx.x; j < h; j += BLOCK) {
        float normed = round_as<T>(widen(xr[j]) * r);
        y[row * h + j] = narrow<T>(widen(w[j]) * normed);
    }
    if (threadIdx.x == 0) rinv[row] = r;
}

// One row per block: dx += r*g - r^3*x*mean(g*x), g = dy*w.
template <typename T>
__device__ void rmsnorm_bwd_dx(const T* dy, const T* x, const T* w, const float* rinv, T* dx, u32 h) {
    __shared__ float sh[BLOCK];
    u64 row = blockIdx.x;
    u64 o = row * h;
    float dot = 0.0f;
    for (u32 j = threadIdx.x; j < h; j += BLOCK) dot += widen(dy[o + j]) * widen(w[j]) * widen(x[o + j]);
    dot = block_sum(dot, sh);
    float r = rinv[row];
    float c = r * r * r * dot / (float)h;
    for (u32 j = threadIdx.x; j < h; j += BLOCK) {
        float g = widen(dy[o + j]) * widen(w[j]);
        dx[o + j] = narrow<T>(widen(dx[o + j]) + r * g - c * widen(x[o + j]));
    }
}

// dw[j] += sum over rows, in row order, of dy[i, j] * round(x[i, j] * rinv[i]).
template <typename T>
__device__ void rmsnorm_bwd_dw(const T* dy, const T* x, const float* rinv, float* dw, u64 rows, u32 h) {
    u64 j = global_index();
    if (j >= h) return;
    float acc = dw[j];
    for (u64 i = 0; i < rows; ++i) acc += widen(dy[i * h + j]) * round_as<T>(widen(x[i * h + j]) * rinv[i]);
    dw[j] = acc;
}

// Rotates pairs (i, i + half) of every head; row r sits at position r % seq. sign -1: inverse.
template <typename T>
__device__ void rope(T* x, const float* cos_t, const float* sin_t, u64 rows, u32 width, u32 seq, u32 half,
                     float sign) {
    u64 idx = global_index();
    u32 heads = width / (2 * half);
    if (idx >= rows * heads * half) return;
    u32 i = idx % half;
    u64 rest = idx / half;
    u32 head = rest % heads;
    u64 row = rest / heads;
    u64 p = row % seq;
    T* lo = x + row * width + head * 2 * half + i;
    T* hi = lo + half;
    float a = widen(*lo), b = widen(*hi);
    float c = cos_t[p * half + i];
    float s = sign * sin_t[p * half + i];
    *lo = narrow<T>(a * c - b * s);
    *hi = narrow<T>(b * c + a * s);
}

// Residual dropout, as model/dropout.rs draws it: element i is kept when the i-th output of a
// SplitMix64 stream keyed by the (seed, step, layer, site) mask, shifted to its top bits, is at
// least the threshold; kept elements are scaled by 1 / (1 - p).
struct DropoutMask {
    u64 key, threshold;
    u32 shift;
    float scale;
};

__device__ __forceinline__ u64 splitmix(u64 z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ bool dropout_keeps(DropoutMask m, u64 i) {
    return (splitmix(m.key + (i + 1ull) * 0x9E3779B97F4A7C15ull) >> m.shift) >= m.threshold;
}

// out = x + dropout(y).
template <typename T>
__device__ void dropout_add(const T* x, const T* y, T* out, u64 n, DropoutMask m) {
    u64 i = global_index();
    if (i >= n) return;
    out[i] = dropout_keeps(m, i) ? narrow<T>(widen(x[i]) + widen(y[i]) * m.scale) : x[i];
}

// dy = ∂L/∂y of dropout_add from dout = ∂L/∂out.
template <typename T> __device__ void dropout_bwd(const T* dout, T* dy, u64 n, DropoutMask m) {
    u64 i = global_index();
    if (i >= n) return;
    dy[i] = narrow<T>(dropout_keeps(m, i) ? widen(dout[i]) * m.scale : 0.0f);
}

// y[r, j] += b[j] for every row of y ([n / width, width]).
template <typename T> __device__ void add_bias(T* y, const T* b, u64 n, u32 width) {
    u64 i = global_index();
    if (i >= n) return;
    y[i] = narrow<T>(widen(y[i]) + widen(b[i % width]));
}

// db[j] += sum over rows of dy[r, j], one thread per column summing the rows in order.
template <typename T> __device__ void bias_grad(const T* dy, float* db, u64 rows, u32 width) {
    u64 j = global_index();
    if (j >= width) return;
    float s = db[j];
    for (u64 r = 0; r < rows; r++) s += widen(dy[r * width + j]);
    db[j] = s;
}

template <typename T> __device__ void swiglu_fwd(const T* gate, const T* up, T* act, u64 n) {
    u64 i = global_index();
    if (i >= n) return;
    float g = widen(gate[i]);
    float silu = round_as<T>(g * sigmoid(g));
    act[i] = narrow<T>(silu * widen(up[i]));
}

template <typename T>
__device__ void swiglu_bwd(const T* dact, const T* gate, const T* up, T* dgate, T* dup, u64 n) {
    u64 i = global_index();
    if (i >= n) return;
    float g = widen(gate[i]), u = widen(up[i]), da = widen(dact[i]);
    float s = sigmoid(g);
    float silu = round_as<T>(g * s);
    dup[i] = narrow<T>(da * silu);
    dgate[i] = narrow<T>(da * u * s * (1.0f + g * (1.0f - s)));
}

// Attention shapes: q/out/dq are [batch*seq, heads*d], k/v/dk/dv are [batch*seq, kv_heads*d],
// lse/delta are [batch, heads, seq].
// br and bc: the query and key rows of a tile of the tiled kernels below.
struct Attn {
    u32 batch, seq, heads, kv_heads, d;
    float scale;
    u32 br, bc;
};

// Tiled attention: a block holds a tile of a.br query rows (forward, dq) or a.bc key rows (dk,
// dv) and walks the other side's tiles through shared memory, so each key/value (or query/
// output-gradient) row is read from global memory once per tile, not once per row. The
// BLOCK / rows threads of a row each own the columns c = lane + n * (BLOCK / rows), at most
// MAX_COLS of them. Shared rows are d + 1 floats apart, so threads reading the same column of
// different rows hit different banks. Every sum runs in ascending key (or query) order.
#define MAX_COLS 16

// Rows [r0, r0 + n) of the head columns [col, col + d) of a [batch * seq, width] tensor, into
// `dst` (row stride d + 1); rows past the sequence read as zeros.
template <typename T>
__device__ void load_tile(const T* src, u32 b, u32 r0, u32 n, u64 width, u64 col, Attn a, float* dst) {
    for (u32 e = threadIdx.x; e < n * a.d; e += BLOCK) {
        u32 r = e / a.d, c = e % a.d;
        u32 row = r0 + r;
        dst[r * (a.d + 1) + c] = row < a.seq ? widen(src[((u64)b * a.seq + row) * width + col + c]) : 0.0f;
    }
}

// Waits until the block is done with its key and value tiles, loads rows [j0, j0 + a.bc) of kv
// head g into `ks` and `vs`, and waits until every thread has loaded its part.
template <typename T>
__device__ void next_kv_tile(const T* k, const T* v, u32 b, u32 j0, u32 g, Attn a, float* ks, float* vs) {
    u64 kw = (u64)a.kv_heads * a.d;
    __syncthreads();
    load_tile(k, b, j0, a.bc, kw, (u64)g * a.d, a, ks);
    load_tile(v, b, j0, a.bc, kw, (u64)g * a.d, a, vs);
    __syncthreads();
}

// The forward pass of a.br query rows (blockIdx.x) of one head (y) of one sequence (z), with the
// running maximum and sum of a streaming softmax. Dynamic shared memory: the query tile, a key
// and a value tile, and the tile's scores.
template <typename T>
__device__ void attn_fwd(const T* q, const T* k, const T* v, T* out, float* lse, Attn a) {
    extern __shared__ float dyn[];
    u32 tpr = BLOCK / a.br, r = threadIdx.x / tpr, lane = threadIdx.x % tpr;
    u32 i0 = blockIdx.x * a.br, h = blockIdx.y, b = blockIdx.z;
    u32 g = h / (a.heads / a.kv_heads), ds = a.d + 1, ps_w = a.bc + 1;
    u64 qw = (u64)a.heads * a.d;
    float* qs = dyn;
    float* ks = qs + a.br * ds;
    float* vs = ks + a.bc * ds;
    float* ps = vs + a.bc * ds;
    const float NEG_INF = -__int_as_float(0x7f800000);
    u32 i = i0 + r;
    bool row_ok = i < a.seq;
    load_tile(q, b, i0, a.br, qw, (u64)h * a.d, a, qs);
    float m = NEG_INF, l = 0.0f;
    float acc[MAX_COLS];
    for (u32 n = 0; n < MAX_COLS; ++n) acc[n] = 0.0f;
    u32 last = min(i0 + a.br, a.seq) - 1;
    for (u32 j0 = 0; j0 <= last; j0 += a.bc) {
        next_kv_tile(k, v, b, j0, g, a, ks, vs);
        for (u32 jj = lane; jj < a.bc; jj += tpr) {
            float s = NEG_INF;
            if (row_ok && j0 + jj <= i) {
                float dot = 0.0f;
                for (u32 c = 0; c < a.d; ++c) dot += qs[r * ds + c] * ks[jj * ds + c];
                s = a.scale * dot;
            }
            ps[r * ps_w + jj] = s;
        }
        __syncthreads();
        float mt = m;
        for (u32 jj = 0; jj < a.bc; ++jj) mt = fmaxf(mt, ps[r * ps_w + jj]);
        if (mt == NEG_INF) continue;
        float alpha = cpu_exp(m - mt);
        l *= alpha;
        for (u32 n = 0; n < MAX_COLS; ++n) acc[n] *= alpha;
        for (u32 jj = 0; jj < a.bc; ++jj) {
            float p = cpu_exp(ps[r * ps_w + jj] - mt);
            l += p;
            for (u32 n = 0; n < MAX_COLS; ++n) {
                u32 c = lane + n * tpr;
                if (c < a.d) acc[n] += p * vs[jj * ds + c];
            }
        }
        m = mt;
    }
    if (!row_ok) return;
    u64 qrow = ((u64)b * a.seq + i) * qw + (u64)h * a.d;
    float inv = 1.0f / l;
    for (u32 n = 0; n < MAX_COLS; ++n) {
        u32 c = lane + n * tpr;
        if (c < a.d) out[qrow + c] = narrow<T>(acc[n] * inv);
    }
    if (lane == 0) lse[((u64)b * a.heads + h) * a.seq + i] = m + logf(l);
}

// delta[b, h, i] = dout_i . out_i, one thread per query row of a head.
template <typename T> __device__ void attn_delta(const T* out, const T* dout, float* delta, Attn a) {
    u64 idx = global_index();
    if (idx >= (u64)a.batch * a.heads * a.seq) return;
    u32 i = idx % a.seq;
    u64 bh = idx / a.seq;
    u32 h = bh % a.heads;
    u64 b = bh / a.heads;
    u64 row = (b * a.seq + i) * a.heads * a.d + (u64)h * a.d;
    float s = 0.0f;
    for (u32 c = 0; c < a.d; ++c) s += widen(dout[row + c]) * widen(out[row + c]);
    delta[idx] = s;
}

// p and the score gradient p * (dout_i . v_j - delta_i) * scale of query row i against key j.
struct ScoreGrad {
    float p, ds;
};
__device__ __forceinline__ ScoreGrad score_grad(float q_dot_k, float do_dot_v, float lse_i, float delta_i,
                                                float scale) {
    float p = cpu_exp(q_dot_k * scale - lse_i);
    ScoreGrad r = {p, p * (do_dot_v - delta_i) * scale};
    return r;
}

// dq for a.br query rows (blockIdx.x) of one head (y) of one sequence (z): each row sums its
// score gradients times the keys in ascending key order. Dynamic shared memory: the query and
// output-gradient tiles, a key and a value tile, and the tile's score gradients.
template <typename T>
__device__ void attn_bwd_dq(const T* q, const T* k, const T* v, const T* dout, const float* lse,
                            const float* delta, T* dq, Attn a) {
    extern __shared__ float dyn[];
    u32 tpr = BLOCK / a.br, r = threadIdx.x / tpr, lane = threadIdx.x % tpr;
    u32 i0 = blockIdx.x * a.br, h = blockIdx.y, b = blockIdx.z;
    u32 g = h / (a.heads / a.kv_heads), ds = a.d + 1, ds_w = a.bc + 1;
    u64 qw = (u64)a.heads * a.d;
    float* qs = dyn;
    float* dos = qs + a.br * ds;
    float* ks = dos + a.br * ds;
    float* vs = ks + a.bc * ds;
    float* dss = vs + a.bc * ds;
    u32 i = i0 + r;
    bool row_ok = i < a.seq;
    load_tile(q, b, i0, a.br, qw, (u64)h * a.d, a, qs);
    load_tile(dout, b, i0, a.br, qw, (u64)h * a.d, a, dos);
    u64 bhi = ((u64)b * a.heads + h) * a.seq + i;
    float lse_i = row_ok ? lse[bhi] : 0.0f, delta_i = row_ok ? delta[bhi] : 0.0f;
    float acc[MAX_COLS];
    for (u32 n = 0; n < MAX_COLS; ++n) acc[n] = 0.0f;
    u32 last = min(i0 + a.br, a.seq) - 1;
    for (u32 j0 = 0; j0 <= last; j0 += a.bc) {
        next_kv_tile(k, v, b, j0, g, a, ks, vs);
        for (u32 jj = lane; jj < a.bc; jj += tpr) {
            float d_s = 0.0f;
            if (row_ok && j0 + jj <= i) {
                float s = 0.0f, dp = 0.0f;
                for (u32 c = 0; c < a.d; ++c) {
                    s += qs[r * ds + c] * ks[jj * ds + c];
                    dp += dos[r * ds + c] * vs[jj * ds + c];
                }
                d_s = score_grad(s, dp, lse_i, delta_i, a.scale).ds;
            }
            dss[r * ds_w + jj] = d_s;
        }
        __syncthreads();
        for (u32 jj = 0; jj < a.bc && j0 + jj <= i; ++jj) {
            float d_s = dss[r * ds_w + jj];
            for (u32 n = 0; n < MAX_COLS; ++n) {
                u32 c = lane + n * tpr;
                if (c < a.d) acc[n] += d_s * ks[jj * ds + c];
            }
        }
    }
    if (!row_ok) return;
    u64 qrow = ((u64)b * a.seq + i) * qw + (u64)h * a.d;
    for (u32 n = 0; n < MAX_COLS; ++n) {
        u32 c = lane + n * tpr;
        if (c < a.d) dq[qrow + c] = narrow<T>(acc[n]);
    }
}

// dk and dv for a.bc key rows (blockIdx.x) of one kv head (y) of one sequence (z): each key row
// sums over the group's heads in order, then over query rows i >= j in ascending order, a.br at a
// time. Dynamic shared memory: the key and value tiles, a query and an output-gradient tile,
// their probabilities and score gradients, and the query rows' log-sum-exp and delta.
template <typename T>
__device__ void attn_bwd_dkv(const T* q, const T* k, const T* v, const T* dout, const float* lse,
                             const float* delta, T* dk, T* dv, Attn a) {
    extern __shared__ float dyn[];
    u32 tpk = BLOCK / a.bc, jr = threadIdx.x / tpk, lane = threadIdx.x % tpk;
    u32 j0 = blockIdx.x * a.bc, g = blockIdx.y, b = blockIdx.z;
    u32 group = a.heads / a.kv_heads, ds = a.d + 1, pw = a.bc + 1;
    u64 qw = (u64)a.heads * a.d, kw = (u64)a.kv_heads * a.d;
    float* ks = dyn;
    float* vs = ks + a.bc * ds;
    float* qs = vs + a.bc * ds;
    float* dos = qs + a.br * ds;
    float* ps = dos + a.br * ds;
    float* dss = ps + a.br * pw;
    float* lses = dss + a.br * pw;
    float* deltas = lses + a.br;
    u32 j = j0 + jr;
    bool row_ok = j < a.seq;
    load_tile(k, b, j0, a.bc, kw, (u64)g * a.d, a, ks);
    load_tile(v, b, j0, a.bc, kw, (u64)g * a.d, a, vs);
    float acc_k[MAX_COLS], acc_v[MAX_COLS];
    for (u32 n = 0; n < MAX_COLS; ++n) acc_k[n] = acc_v[n] = 0.0f;
    for (u32 h = g * group; h < (g + 1) * group; ++h) {
        for (u32 i0 = j0 / a.br * a.br; i0 < a.seq; i0 += a.br) {
            __syncthreads();
            load_tile(q, b, i0, a.br, qw, (u64)h * a.d, a, qs);
            load_tile(dout, b, i0, a.br, qw, (u64)h * a.d, a, dos);
            for (u32 e = threadIdx.x; e < a.br; e += BLOCK) {
                u64 bhi = ((u64)b * a.heads + h) * a.seq + i0 + e;
                bool ok = i0 + e < a.seq;
                lses[e] = ok ? lse[bhi] : 0.0f;
                deltas[e] = ok ? delta[bhi] : 0.0f;
            }
            __syncthreads();
            for (u32 ii = lane; ii < a.br; ii += tpk) {
                u32 i = i0 + ii;
                float p = 0.0f, d_s = 0.0f;
                if (row_ok && i < a.seq && i >= j) {
                    float s = 0.0f, dp = 0.0f;
                    for (u32 c = 0; c < a.d; ++c) {
                        s += qs[ii * ds + c] * ks[jr * ds + c];
                        dp += dos[ii * ds + c] * vs[jr * ds + c];
                    }
                    ScoreGrad pd = score_grad(s, dp, lses[ii], deltas[ii], a.scale);
                    p = pd.p;
                    d_s = pd.ds;
                }
                ps[ii * pw + jr] = p;
                dss[ii * pw + jr] = d_s;
            }
            __syncthreads();
            for (u32 ii = 0; ii < a.br; ++ii) {
                if (i0 + ii < j || i0 + ii >= a.seq) continue;
                float p = ps[ii * pw + jr], d_s = dss[ii * pw + jr];
                for (u32 n = 0; n < MAX_COLS; ++n) {
                    u32 c = lane + n * tpk;
                    if (c < a.d) {
                        acc_v[n] += p * dos[ii * ds + c];
                        acc_k[n] += d_s * qs[ii * ds + c];
                    }
                }
            }
        }
    }
    if (!row_ok) return;
    u64 krow = ((u64)b * a.seq + j) * kw + (u64)g * a.d;
    for (u32 n = 0; n < MAX_COLS; ++n) {
        u32 c = lane + n * tpk;
        if (c < a.d) {
            dk[krow + c] = narrow<T>(acc_k[n]);
            dv[krow + c] = narrow<T>(acc_v[n]);
        }
    }
}

// One row of logits per block, replaced by scale * (softmax - onehot(label)); row_loss gets
// logsumexp - logit[label]. An ignored row (label -100) becomes zeros and loss 0.
template <typename T>
__device__ void xent(T* logits, const long long* labels, float* row_loss, u32 vocab, float scale) {
    __shared__ float sh[BLOCK];
    u64 row = blockIdx.x;
    T* x = logits + row * vocab;
    long long label = labels[row];
    if (label == -100) {
        for (u32 j = threadIdx.x; j < vocab; j += BLOCK) x[j] = narrow<T>(0.0f);
        if (threadIdx.x == 0) row_loss[row] = 0.0f;
        return;
    }
    float logit = widen(x[label]);
    float mx = -__int_as_float(0x7f800000);
    for (u32 j = threadIdx.x; j < vocab; j += BLOCK) mx = fmaxf(mx, widen(x[j]));
    mx = block_max(mx, sh);
    float sum = 0.0f;
    for (u32 j = threadIdx.x; j < vocab; j += BLOCK) sum += cpu_exp(widen(x[j]) - mx);
    sum = block_sum(sum, sh);
    float lse = mx + logf(sum);
    for (u32 j = threadIdx.x; j < vocab; j += BLOCK) x[j] = narrow<T>(scale * cpu_exp(widen(x[j]) - lse));
    __syncthreads();
    if (threadIdx.x == 0) {
        x[label] = narrow<T>(scale * (cpu_exp(logit - lse) - 1.0f));
        row_loss[row] = lse - logit;
    }
}

#define DEFINE_KERNELS(T, S)                                                                              \
    extern "C" __global__ void embedding_fwd_##S(const T* table, const u32* ids, T* out, u64 rows,       \
                                                 u64 width) {                                            \
        embedding_fwd<T>(table, ids, out, rows, width);                                                  \
    }                                                                                                    \
    extern "C" __global__ void embedding_bwd_##S(const T* dout, const u32* positions, const u32* starts, \
                                                 const u32* ids, float* dtable, u64 width) {             \
        embedding_bwd<T>(dout, positions, starts, ids, dtable, width);                                   \
    }                                                                                                    \
    extern "C" __global__ void rmsnorm_fwd_##S(const T* x, const T* w, T* y, float* rinv, u32 h,         \
                                               float eps) {                                              \
        rmsnorm_fwd<T>(x, w, y, rinv, h, eps);                                                           \
    }                                                                                                    \
    extern "C" __global__ void rmsnorm_bwd_dx_##S(const T* dy, const T* x, const T* w, const float* rinv, \
                                                  T* dx, u32 h) {                                        \
        rmsnorm_bwd_dx<T>(dy, x, w, rinv, dx, h);                                                        \
    }                                                                                                    \
    extern "C" __global__ void rmsnorm_bwd_dw_##S(const T* dy, const T* x, const float* rinv, float* dw, \
                                                  u64 rows, u32 h) {                                     \
        rmsnorm_bwd_dw<T>(dy, x, rinv, dw, rows, h);                                                     \
    }                                                                                                    \
    extern "C" __global__ void rope_##S(T* x, const float* cos_t, const float* sin_t, u64 rows, u32 width, \
                                        u32 seq, u32 half, float sign) {                                 \
        rope<T>(x, cos_t, sin_t, rows, width, seq, half, sign);                                          \
    }                                                                                                    \
    extern "C" __global__ void dropout_add_##S(const T* x, const T* y, T* out, u64 n, DropoutMask m) {   \
        dropout_add<T>(x, y, out, n, m);                                                                 \
    }                                                                                                    \
    extern "C" __global__ void dropout_bwd_##S(const T* dout, T* dy, u64 n, DropoutMask m) {             \
        dropout_bwd<T>(dout, dy, n, m);                                                                  \
    }                                                                                                    \
    extern "C" __global__ void add_bias_##S(T* y, const T* b, u64 n, u32 width) {                      \
        add_bias<T>(y, b, n, width);                                                                     \
    }                                                                                                    \
    extern "C" __global__ void bias_grad_##S(const T* dy, float* db, u64 rows, u32 width) {             \
        bias_grad<T>(dy, db, rows, width);                                                               \
    }                                                                                                    \
    extern "C" __global__ void swiglu_fwd_##S(const T* gate, const T* up, T* act, u64 n) {               \
        swiglu_fwd<T>(gate, up, act, n);                                                                 \
    }                                                                                                    \
    extern "C" __global__ void swiglu_bwd_##S(const T* dact, const T* gate, const T* up, T* dgate,       \
                                              T* dup, u64 n) {                                           \
        swiglu_bwd<T>(dact, gate, up, dgate, dup, n);                                                    \
    }                                                                                                    \
    extern "C" __global__ void attn_fwd_##S(const T* q, const T* k, const T* v, T* out, float* lse,      \
                                            Attn a) {                                                    \
        attn_fwd<T>(q, k, v, out, lse, a);                                                               \
    }                                                                                                    \
    extern "C" __global__ void attn_delta_##S(const T* out, const T* dout, float* delta, Attn a) {       \
        attn_delta<T>(out, dout, delta, a);                                                              \
    }                                                                                                    \
    extern "C" __global__ void attn_bwd_dq_##S(const T* q, const T* k, const T* v, const T* dout,        \
                                               const float* lse, const float* delta, T* dq, Attn a) {    \
        attn_bwd_dq<T>(q, k, v, dout, lse, delta, dq, a);                                                \
    }                                                                                                    \
    extern "C" __global__ void attn_bwd_dkv_##S(const T* q, const T* k, const T* v, const T* dout,       \
                                                const float* lse, const float* delta, T* dk, T* dv,      \
                                                Attn a) {                                                \
        attn_bwd_dkv<T>(q, k, v, dout, lse, delta, dk, dv, a);                                           \
    }                                                                                                    \
    extern "C" __global__ void xent_##S(T* logits, const long long* labels, float* row_loss, u32 vocab,  \
                                        float scale) {                                                   \
        xent<T>(logits, labels, row_loss, vocab, scale);                                                 \
    }

DEFINE_KERNELS(float, f32)
DEFINE_KERNELS(bf16, bf16)

// f32 -> bf16 with the CPU's rounding (the compute copy of the master weights).
extern "C" __global__ void f32_to_bf16(const float* src, bf16* dst, u64 n) {
    u64 i = global_index();
    if (i < n) dst[i] = narrow<bf16>(src[i]);
}

// AdamW on f32 parameters, in the CPU backend's order of operations.
struct AdamWArgs {
    float decay, one_minus_b1, b2, one_minus_b2, eps, step_size, bc2_sqrt;
};

extern "C" __global__ void adamw(float* p, const float* g, float* m, float* v, u64 n, AdamWArgs a) {
    u64 i = global_index();
    if (i >= n) return;
    float pi = p[i] * a.decay;
    float gi = g[i];
    float mi = m[i] + (gi - m[i]) * a.one_minus_b1;
    float vi = v[i] * a.b2 + a.one_minus_b2 * gi * gi;
    float denom = sqrtf(vi) / a.bc2_sqrt + a.eps;
    p[i] = pi - a.step_size * mi / denom;
    m[i] = mi;
    v[i] = vi;
}

// partial[c] = sum of x^2 (in f64, in order) over chunk c of `chunk` elements: the CPU's partials.
extern "C" __global__ void sumsq_chunks(const float* x, double* partial, u64 n, u64 chunk) {
    u64 c = global_index();
    u64 start = c * chunk;
    if (start >= n) return;
    u64 end = start + chunk < n ? start + chunk : n;
    double s = 0.0;
    for (u64 i = start; i < end; ++i) s += (double)x[i] * (double)x[i];
    partial[c] = s;
}

extern "C" __global__ void scale_f32(float* x, u64 n, float coef) {
    u64 i = global_index();
    if (i < n) x[i] *= coef;
}
