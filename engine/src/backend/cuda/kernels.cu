// Kernels of the CUDA backend. Compiled by NVRTC with --fmad=false, so every multiply and add
// rounds on its own as it does in the CPU backend's Rust code, and with no headers: bf16 is
// stored as its 16 bits and converted here with the `half` crate's rounding.
//
// Storage types are float and bf16; arithmetic is f32. Each kernel of the model exists as
// `<name>_f32` and `<name>_bf16` (see DEFINE_KERNELS); the optimizer's kernels are f32 only;
// attention on tensor cores is bf16 only (DEFINE_TC_KERNELS, one set per head width).
// Sums never use atomics: a value is reduced by one thread in a fixed order, by a fixed tree
// over one block's threads, or by tensor-core products in a fixed order, so every run gives the
// same bits.

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

// Warps of a block of rmsnorm_bwd_dw (DW_WARPS * 32 threads).
#define DW_WARPS 32

// dw[j] += sum over rows of dy[i, j] * round(x[i, j] * rinv[i]), in two stages: a block owns 32
// columns, one per lane; each of its warps sums a contiguous share of the rows in row order,
// and the shares are added to dw in warp order. The order is fixed, so every run gives the same
// bits, and a card's threads are busy even where the model is narrow.
template <typename T>
__device__ void rmsnorm_bwd_dw(const T* dy, const T* x, const float* rinv, float* dw, u64 rows, u32 h) {
    __shared__ float share_sum[DW_WARPS][32];
    u32 lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    u64 j = (u64)blockIdx.x * 32 + lane;
    u64 share = (rows + DW_WARPS - 1) / DW_WARPS;
    u64 begin = warp * share < rows ? warp * share : rows;
    u64 end = begin + share < rows ? begin + share : rows;
    float acc = 0.0f;
    if (j < h)
        for (u64 i = begin; i < end; ++i) acc += widen(dy[i * h + j]) * round_as<T>(widen(x[i * h + j]) * rinv[i]);
    share_sum[warp][lane] = acc;
    __syncthreads();
    if (warp != 0 || j >= h) return;
    float total = dw[j];
    for (u32 w = 0; w < DW_WARPS; ++w) total += share_sum[w][lane];
    dw[j] = total;
}

// Rotates pairs (i, i + half) of every head; row r sits at position pos[r] (a packed batch's), else
// r % seq. sign -1: inverse.
template <typename T>
__device__ void rope(T* x, const float* cos_t, const float* sin_t, u64 rows, u32 width, u32 seq, u32 half,
                     float sign, const u32* pos) {
    u64 idx = global_index();
    u32 heads = width / (2 * half);
    if (idx >= rows * heads * half) return;
    u32 i = idx % half;
    u64 rest = idx / half;
    u32 head = rest % heads;
    u64 row = rest / heads;
    u64 p = pos ? pos[row] : row % seq;
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

// x[r, :] *= w[r] for the n elements of x, rows of `width`.
template <typename T> __device__ void scale_rows(T* x, const T* w, u64 n, u64 width) {
    u64 i = global_index();
    if (i >= n) return;
    x[i] = narrow<T>(widen(x[i]) * widen(w[i / width]));
}

// dst[rows[r], :] += round(w[r] * src[r, :]) (w[r] = 1 without weights) for the n elements of src.
// The rows are distinct, so no two threads write one element.
template <typename T>
__device__ void scatter_add_rows(const T* src, const u32* rows, const T* w, T* dst, u64 n, u64 width) {
    u64 i = global_index();
    if (i >= n) return;
    u64 r = i / width;
    float v = widen(src[i]);
    if (w) v = round_as<T>(v * widen(w[r]));
    u64 d = (u64)rows[r] * width + i % width;
    dst[d] = narrow<T>(widen(dst[d]) + v);
}

// One row per block: out[r] = sum_j a[r, j] * b[r, j].
template <typename T> __device__ void row_dots(const T* a, const T* b, float* out, u32 width) {
    __shared__ float sh[BLOCK];
    u64 o = (u64)blockIdx.x * width;
    float dot = 0.0f;
    for (u32 j = threadIdx.x; j < width; j += BLOCK) dot += widen(a[o + j]) * widen(b[o + j]);
    dot = block_sum(dot, sh);
    if (threadIdx.x == 0) out[blockIdx.x] = dot;
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
// pos: a packed batch's positions ([batch * seq], each token's place in its document), or null.
struct Attn {
    u32 batch, seq, heads, kv_heads, d;
    float scale;
    u32 br, bc;
    const u32* pos;
};

// The first key query row i of sequence b sees: its document's first row in a packed batch, else
// the sequence's first. Key j is visible to query i when first_key(a, b, i) <= j <= i.
__device__ __forceinline__ u32 first_key(Attn a, u32 b, u32 i) {
    return a.pos && i < a.seq ? i - a.pos[(u64)b * a.seq + i] : 0;
}

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
    u32 first = first_key(a, b, i);
    load_tile(q, b, i0, a.br, qw, (u64)h * a.d, a, qs);
    float m = NEG_INF, l = 0.0f;
    float acc[MAX_COLS];
    for (u32 n = 0; n < MAX_COLS; ++n) acc[n] = 0.0f;
    u32 last = min(i0 + a.br, a.seq) - 1;
    for (u32 j0 = 0; j0 <= last; j0 += a.bc) {
        next_kv_tile(k, v, b, j0, g, a, ks, vs);
        for (u32 jj = lane; jj < a.bc; jj += tpr) {
            float s = NEG_INF;
            if (row_ok && j0 + jj <= i && j0 + jj >= first) {
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
    u32 first = first_key(a, b, i);
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
            if (row_ok && j0 + jj <= i && j0 + jj >= first) {
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
                if (row_ok && i < a.seq && i >= j && j >= first_key(a, b, i)) {
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

// Tensor-core attention, for bf16 storage and heads D = 16 * KD wide (KD at most 8), on sm_80
// and later. A block is TC_WARPS warps. Each warp owns 16 rows of the block's side (query rows
// in the forward pass and dq, key rows in dk/dv) and holds them in registers as mma.sync A
// fragments; the block streams the other side's rows through shared memory NS = 8 * NT at a
// time, double-buffered with cp.async. Products are mma.sync m16n8k16 with bf16 operands and f32
// accumulation; probabilities and score gradients become bf16 operands of the second product,
// as in FlashAttention-2, and never leave registers. Every sum runs over the streamed rows in
// ascending order, a tile at a time, and nothing is atomic, so every run gives the same bits.
// Fragment layouts are PTX's for m16n8k16: lane l holds rows l / 4 and l / 4 + 8 of a 16-row
// fragment, columns 2 (l % 4) and 2 (l % 4) + 1 of each 8-column piece.
#define TC_WARPS 4
#define TC_THREADS (32 * TC_WARPS)
#define TC_ROWS (16 * TC_WARPS)
// bf16 elements past each shared row (16 bytes): the 8 rows one ldmatrix reads fall in
// different banks.
#define TC_PAD 8

#if defined(__CUDACC_RTC__)
// The warp-level instructions, as inline PTX; the host emulation defines the same functions.
__device__ __forceinline__ u32 shared_address(const void* p) {
    u32 r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}
__device__ __forceinline__ void ldmatrix_x4(u32 r[4], const bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 r[4], const bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(p)));
}
// c += a * b for a 16 x 16 A fragment, a 16 x 8 B fragment and a 16 x 8 f32 C fragment.
__device__ __forceinline__ void mma_bf16_16816(float c[4], const u32 a[4], const u32 b[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void cp_async16(bf16* dst, const bf16* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(shared_address(dst)), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
// Waits until at most N of this thread's committed groups of copies are in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
}
// The value `v` of the lane whose index is this lane's xor `mask`.
__device__ __forceinline__ float warp_xor(float v, int mask) {
    float r;
    asm volatile("shfl.sync.bfly.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=f"(r) : "f"(v), "r"(mask));
    return r;
}
#endif

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
// Queues the copy of rows [r0, r0 + n) of the head columns [col, col + d) of a [batch * seq,
// width] tensor into `dst` (row stride d + TC_PAD), 16 bytes per cp.async; rows past the
// sequence are zeroed at once.
__device__ void tc_load_rows(const bf16* src, u32 b, u32 r0, u32 n, u64 width, u64 col, u32 d, Attn a,
                             bf16* dst) {
    u32 chunks = d / 8, sd = d + TC_PAD;
    for (u32 e = threadIdx.x; e < n * chunks; e += TC_THREADS) {
        u32 r = e / chunks, c = e % chunks * 8;
        bf16* to = dst + r * sd + c;
        if (r0 + r < a.seq)
            cp_async16(to, src + ((u64)b * a.seq + r0 + r) * width + col + c);
        else
            for (u32 x = 0; x < 8; ++x) to[x] = 0;
    }
}

// Queues rows [r0, r0 + n) of `x` and then of `y` into `dst` (n rows each) as one group.
__device__ void tc_load_pair(const bf16* x, const bf16* y, u32 b, u32 r0, u32 n, u64 width, u64 col, u32 d,
                             Attn a, bf16* dst) {
    tc_load_rows(x, b, r0, n, width, col, d, a, dst);
    tc_load_rows(y, b, r0, n, width, col, d, a, dst + n * (d + TC_PAD));
    cp_async_commit();
}

// The A fragment of rows [row0, row0 + 16) and columns [k0, k0 + 16) of a shared tile.
__device__ __forceinline__ void tc_load_a(u32 f[4], const bf16* tile, u32 sd, u32 row0, u32 k0) {
    u32 lane = threadIdx.x % 32, m = lane / 8;
    ldmatrix_x4(f, tile + (row0 + lane % 8 + (m & 1) * 8) * sd + k0 + (m >> 1) * 8);
}

// B fragments over k in [k0, k0 + 16) of the column pieces [n0, n0 + 8) (f[0], f[1]) and
// [n0 + 8, n0 + 16) (f[2], f[3]) of B[k][n] = tile[n][k]: the tile's rows are B's columns.
__device__ __forceinline__ void tc_load_b_rows(u32 f[4], const bf16* tile, u32 sd, u32 n0, u32 k0) {
    u32 lane = threadIdx.x % 32, m = lane / 8;
    ldmatrix_x4(f, tile + (n0 + lane % 8 + (m >> 1) * 8) * sd + k0 + (m & 1) * 8);
}

// As tc_load_b_rows for B[k][n] = tile[k][n]: the tile's rows are B's rows (ldmatrix transposes).
__device__ __forceinline__ void tc_load_b_cols(u32 f[4], const bf16* tile, u32 sd, u32 k0, u32 n0) {
    u32 lane = threadIdx.x % 32, m = lane / 8;
    ldmatrix_x4_trans(f, tile + (k0 + lane % 8 + (m & 1) * 8) * sd + n0 + (m >> 1) * 8);
}

__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    return (u32)narrow<bf16>(lo) | ((u32)narrow<bf16>(hi) << 16);
}

// This warp's 16 owned rows of a shared tile as KD A fragments.
template <int KD> __device__ void tc_fragments(u32 f[KD][4], const bf16* tile) {
    u32 row0 = threadIdx.x / 32 * 16;
    for (int kc = 0; kc < KD; ++kc) tc_load_a(f[kc], tile, KD * 16 + TC_PAD, row0, kc * 16);
}

// This warp's 16 of the block's TC_ROWS rows from r0 of `src`'s head columns [col, col + D), as
// A fragments, copied through `staging`, which the block may reuse once this returns.
template <int KD>
__device__ void tc_own_rows(u32 f[KD][4], const bf16* src, u32 b, u32 r0, u64 width, u64 col, Attn a,
                            bf16* staging) {
    tc_load_rows(src, b, r0, TC_ROWS, width, col, KD * 16, a, staging);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    tc_fragments<KD>(f, staging);
    __syncthreads();
}

// Zeroes N C fragments.
template <int N> __device__ __forceinline__ void tc_clear(float acc[N][4]) {
    for (int n = 0; n < N; ++n)
        for (int e = 0; e < 4; ++e) acc[n][e] = 0.0f;
}

// acc = A * tile^T: the warp's 16 rows (fragments `a`) against each of the tile's NS rows.
template <int KD, int NT>
__device__ __forceinline__ void tc_scores(float acc[NT][4], const u32 a[KD][4], const bf16* tile) {
    tc_clear<NT>(acc);
    for (int kc = 0; kc < KD; ++kc)
        for (int n = 0; n < NT; n += 2) {
            u32 f[4];
            tc_load_b_rows(f, tile, KD * 16 + TC_PAD, n * 8, kc * 16);
            mma_bf16_16816(acc[n], a[kc], f);
            mma_bf16_16816(acc[n + 1], a[kc], f + 2);
        }
}

// acc += P * tile: `p` (16 x NS, in C fragments) rounded to bf16 A fragments, times the tile's
// NS rows of D columns, 16 rows at a time in ascending order.
template <int KD, int NT>
__device__ __forceinline__ void tc_accumulate(float acc[2 * KD][4], const float p[NT][4], const bf16* tile) {
    for (int kc = 0; kc < NT / 2; ++kc) {
        const float* lo = p[2 * kc];
        const float* hi = p[2 * kc + 1];
        u32 pa[4] = {pack_bf16(lo[0], lo[1]), pack_bf16(lo[2], lo[3]), pack_bf16(hi[0], hi[1]),
                     pack_bf16(hi[2], hi[3])};
        for (int n = 0; n < 2 * KD; n += 2) {
            u32 f[4];
            tc_load_b_cols(f, tile, KD * 16 + TC_PAD, kc * 16, n * 8);
            mma_bf16_16816(acc[n], pa, f);
            mma_bf16_16816(acc[n + 1], pa, f + 2);
        }
    }
}

// The column of element e of C fragment n within its tile.
__device__ __forceinline__ u32 tc_col(int n, int e) { return n * 8 + threadIdx.x % 4 * 2 + (e & 1); }

// The row of this thread's half `half` (elements 2 half and 2 half + 1 of every C fragment) of
// the warp's 16 rows from row0.
__device__ __forceinline__ u32 tc_row(u32 row0, int half) { return row0 + threadIdx.x % 32 / 4 + half * 8; }

// Writes this thread's part of the warp's 16 rows `row0 + ...` of `acc` times `mul[row]`, where
// those rows are below `a.seq`, into the head columns [col, col + D) of `dst`.
template <int KD>
__device__ void tc_store(bf16* dst, const float acc[2 * KD][4], const float mul[2], u32 b, u32 row0, u64 width,
                         u64 col, Attn a) {
    for (int r = 0; r < 2; ++r) {
        u32 i = tc_row(row0, r);
        if (i >= a.seq) continue;
        bf16* row = dst + ((u64)b * a.seq + i) * width + col;
        for (int n = 0; n < 2 * KD; ++n) {
            row[tc_col(n, 0)] = narrow<bf16>(acc[n][2 * r] * mul[r]);
            row[tc_col(n, 1)] = narrow<bf16>(acc[n][2 * r + 1] * mul[r]);
        }
    }
}

// Double-buffered streaming of `tiles` tiles: tile t's pair of NS-row tiles lands in buffer
// t % 2 of `buf` while tile t - 1 is used. `load(t, dst)` queues tile t into dst; `use(t, src)`
// consumes it.
template <class Load, class Use> __device__ void tc_stream(u32 tiles, u32 tile_elems, bf16* buf, Load load, Use use) {
    load(0, buf);
    for (u32 t = 0; t < tiles; ++t) {
        if (t + 1 < tiles) {
            load(t + 1, buf + (t + 1) % 2 * 2 * tile_elems);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        use(t, buf + t % 2 * 2 * tile_elems);
        __syncthreads();
    }
}

// The forward pass of TC_ROWS query rows (blockIdx.x) of one head (y) of one sequence (z):
// streaming softmax over key tiles of NS rows. Dynamic shared memory: two buffers of a key and a
// value tile; the query tile passes through them into registers first.
template <int KD, int NT>
__device__ void attn_tc_fwd(const bf16* q, const bf16* k, const bf16* v, bf16* out, float* lse, Attn a) {
    extern __shared__ float dyn[];
    const u32 D = KD * 16, NS = NT * 8, tile = NS * (D + TC_PAD);
    if (a.d != D || a.bc != NS) __trap();
    bf16* buf = (bf16*)dyn;
    u32 i0 = blockIdx.x * TC_ROWS, h = blockIdx.y, b = blockIdx.z;
    u32 g = h / (a.heads / a.kv_heads), row0 = i0 + threadIdx.x / 32 * 16;
    u64 qw = (u64)a.heads * D, kw = (u64)a.kv_heads * D;
    u32 qf[KD][4];
    tc_own_rows<KD>(qf, q, b, i0, qw, (u64)h * D, a, buf);
    const float NEG_INF = -__int_as_float(0x7f800000);
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
    float o[2 * KD][4];
    tc_clear<2 * KD>(o);
    u32 tiles = (min(i0 + TC_ROWS, a.seq) - 1) / NS + 1;
    auto load = [&](u32 t, bf16* dst) { tc_load_pair(k, v, b, t * NS, NS, kw, (u64)g * D, D, a, dst); };
    const u32 first[2] = {first_key(a, b, tc_row(row0, 0)), first_key(a, b, tc_row(row0, 1))};
    auto use = [&](u32 t, const bf16* ks) {
        float s[NT][4];
        tc_scores<KD, NT>(s, qf, ks);
        float mt[2] = {m[0], m[1]};
        for (int n = 0; n < NT; ++n)
            for (int e = 0; e < 4; ++e) {
                u32 i = tc_row(row0, e >> 1), j = t * NS + tc_col(n, e);
                s[n][e] = j <= i && j >= first[e >> 1] ? a.scale * s[n][e] : NEG_INF;
                mt[e >> 1] = fmaxf(mt[e >> 1], s[n][e]);
            }
        float alpha[2];
        for (int r = 0; r < 2; ++r) {
            mt[r] = fmaxf(mt[r], warp_xor(mt[r], 1));
            mt[r] = fmaxf(mt[r], warp_xor(mt[r], 2));
            alpha[r] = mt[r] == NEG_INF ? 1.0f : cpu_exp(m[r] - mt[r]);
            l[r] *= alpha[r];
            m[r] = mt[r];
        }
        for (int n = 0; n < 2 * KD; ++n)
            for (int e = 0; e < 4; ++e) o[n][e] *= alpha[e >> 1];
        for (int n = 0; n < NT; ++n)
            for (int e = 0; e < 4; ++e) {
                float p = s[n][e] == NEG_INF ? 0.0f : cpu_exp(s[n][e] - m[e >> 1]);
                s[n][e] = p;
                l[e >> 1] += p;
            }
        tc_accumulate<KD, NT>(o, s, ks + tile);
    };
    tc_stream(tiles, tile, buf, load, use);
    float inv[2];
    for (int r = 0; r < 2; ++r) {
        l[r] += warp_xor(l[r], 1);
        l[r] += warp_xor(l[r], 2);
        inv[r] = 1.0f / l[r];
        u32 i = tc_row(row0, r);
        if (i < a.seq && threadIdx.x % 4 == 0) lse[((u64)b * a.heads + h) * a.seq + i] = m[r] + logf(l[r]);
    }
    tc_store<KD>(out, o, inv, b, row0, qw, (u64)h * D, a);
}

// dq for TC_ROWS query rows (blockIdx.x) of one head (y) of one sequence (z): the score
// gradients of each key tile times its keys, tiles in ascending order. The query and output-
// gradient tiles pass through the two buffers into registers first.
template <int KD, int NT>
__device__ void attn_tc_dq(const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse,
                           const float* delta, bf16* dq, Attn a) {
    extern __shared__ float dyn[];
    const u32 D = KD * 16, NS = NT * 8, tile = NS * (D + TC_PAD);
    if (a.d != D || a.bc != NS) __trap();
    bf16* buf = (bf16*)dyn;
    u32 i0 = blockIdx.x * TC_ROWS, h = blockIdx.y, b = blockIdx.z;
    u32 g = h / (a.heads / a.kv_heads), row0 = i0 + threadIdx.x / 32 * 16;
    u64 qw = (u64)a.heads * D, kw = (u64)a.kv_heads * D;
    u32 qf[KD][4], df[KD][4];
    tc_own_rows<KD>(qf, q, b, i0, qw, (u64)h * D, a, buf);
    tc_own_rows<KD>(df, dout, b, i0, qw, (u64)h * D, a, buf);
    float lse_r[2], delta_r[2];
    u32 first[2];
    for (int r = 0; r < 2; ++r) {
        u32 i = tc_row(row0, r);
        u64 bhi = ((u64)b * a.heads + h) * a.seq + i;
        lse_r[r] = i < a.seq ? lse[bhi] : 0.0f;
        delta_r[r] = i < a.seq ? delta[bhi] : 0.0f;
        first[r] = first_key(a, b, i);
    }
    float acc[2 * KD][4];
    tc_clear<2 * KD>(acc);
    u32 tiles = (min(i0 + TC_ROWS, a.seq) - 1) / NS + 1;
    auto load = [&](u32 t, bf16* dst) { tc_load_pair(k, v, b, t * NS, NS, kw, (u64)g * D, D, a, dst); };
    auto use = [&](u32 t, const bf16* ks) {
        float s[NT][4], dp[NT][4];
        tc_scores<KD, NT>(s, qf, ks);
        tc_scores<KD, NT>(dp, df, ks + tile);
        for (int n = 0; n < NT; ++n)
            for (int e = 0; e < 4; ++e) {
                u32 i = tc_row(row0, e >> 1), j = t * NS + tc_col(n, e);
                int r = e >> 1;
                s[n][e] = j <= i && j >= first[r] && i < a.seq ? score_grad(s[n][e], dp[n][e], lse_r[r], delta_r[r], a.scale).ds : 0.0f;
            }
        tc_accumulate<KD, NT>(acc, s, ks);
    };
    tc_stream(tiles, tile, buf, load, use);
    const float one[2] = {1.0f, 1.0f};
    tc_store<KD>(dq, acc, one, b, row0, qw, (u64)h * D, a);
}

// dk and dv for TC_ROWS key rows (blockIdx.x) of one kv head (y) of one sequence (z): over the
// group's heads in order, then over the query tiles at or after the keys in ascending order, the
// probabilities times the output gradients (dv) and the score gradients times the queries (dk).
// The key and value tiles pass through the two buffers into registers first; then query and
// output-gradient tiles stream through them.
template <int KD, int NT>
__device__ void attn_tc_dkv(const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse,
                            const float* delta, bf16* dk, bf16* dv, Attn a) {
    extern __shared__ float dyn[];
    const u32 D = KD * 16, NS = NT * 8, tile = NS * (D + TC_PAD);
    if (a.d != D || a.bc != NS) __trap();
    bf16* buf = (bf16*)dyn;
    u32 j0 = blockIdx.x * TC_ROWS, g = blockIdx.y, b = blockIdx.z;
    u32 group = a.heads / a.kv_heads, row0 = j0 + threadIdx.x / 32 * 16;
    u64 qw = (u64)a.heads * D, kw = (u64)a.kv_heads * D;
    u32 kf[KD][4], vf[KD][4];
    tc_own_rows<KD>(kf, k, b, j0, kw, (u64)g * D, a, buf);
    tc_own_rows<KD>(vf, v, b, j0, kw, (u64)g * D, a, buf);
    float ak[2 * KD][4], av[2 * KD][4];
    tc_clear<2 * KD>(ak);
    tc_clear<2 * KD>(av);
    u32 first = j0 / NS * NS, per_head = (a.seq - first + NS - 1) / NS;
    auto load = [&](u32 t, bf16* dst) {
        u32 h = g * group + t / per_head;
        tc_load_pair(q, dout, b, first + t % per_head * NS, NS, qw, (u64)h * D, D, a, dst);
    };
    auto use = [&](u32 t, const bf16* qs) {
        u32 h = g * group + t / per_head, i0 = first + t % per_head * NS;
        float p[NT][4], ds[NT][4];
        tc_scores<KD, NT>(p, kf, qs);
        tc_scores<KD, NT>(ds, vf, qs + tile);
        for (int n = 0; n < NT; ++n)
            for (int e = 0; e < 4; ++e) {
                u32 j = tc_row(row0, e >> 1), i = i0 + tc_col(n, e);
                ScoreGrad pd = {0.0f, 0.0f};
                if (i < a.seq && i >= j && j >= first_key(a, b, i)) {
                    u64 bhi = ((u64)b * a.heads + h) * a.seq + i;
                    pd = score_grad(p[n][e], ds[n][e], lse[bhi], delta[bhi], a.scale);
                }
                p[n][e] = pd.p;
                ds[n][e] = pd.ds;
            }
        tc_accumulate<KD, NT>(av, p, qs + tile);
        tc_accumulate<KD, NT>(ak, ds, qs);
    };
    tc_stream(group * per_head, tile, buf, load, use);
    const float one[2] = {1.0f, 1.0f};
    tc_store<KD>(dk, ak, one, b, row0, kw, (u64)g * D, a);
    tc_store<KD>(dv, av, one, b, row0, kw, (u64)g * D, a);
}
#endif

// Elements of a row each thread of `xent` reads before it uses them: loads in flight, so that
// a block's reads of its row keep the memory busy.
#define XENT_UNROLL 8

// One row of logits per block, replaced by scale * (softmax - onehot(label)); row_loss gets
// logsumexp - logit[label]. An ignored row (label -100) becomes zeros and loss 0. Thread t
// reads elements t, t + BLOCK, ... of the row, XENT_UNROLL of them at a time; it adds their
// exponentials in that order, the order of the plain loop.
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
    const u32 step = BLOCK * XENT_UNROLL;
    float logit = widen(x[label]);
    float mx = -__int_as_float(0x7f800000);
    float v[XENT_UNROLL];
    for (u32 j0 = threadIdx.x; j0 < vocab; j0 += step) {
#pragma unroll
        for (u32 u = 0; u < XENT_UNROLL; ++u) v[u] = j0 + u * BLOCK < vocab ? widen(x[j0 + u * BLOCK]) : mx;
#pragma unroll
        for (u32 u = 0; u < XENT_UNROLL; ++u) mx = fmaxf(mx, v[u]);
    }
    mx = block_max(mx, sh);
    float sum = 0.0f;
    for (u32 j0 = threadIdx.x; j0 < vocab; j0 += step) {
#pragma unroll
        for (u32 u = 0; u < XENT_UNROLL; ++u) v[u] = j0 + u * BLOCK < vocab ? widen(x[j0 + u * BLOCK]) : 0.0f;
#pragma unroll
        for (u32 u = 0; u < XENT_UNROLL; ++u)
            if (j0 + u * BLOCK < vocab) sum += cpu_exp(v[u] - mx);
    }
    sum = block_sum(sum, sh);
    float lse = mx + logf(sum);
    for (u32 j0 = threadIdx.x; j0 < vocab; j0 += step) {
#pragma unroll
        for (u32 u = 0; u < XENT_UNROLL; ++u) v[u] = j0 + u * BLOCK < vocab ? widen(x[j0 + u * BLOCK]) : 0.0f;
#pragma unroll
        for (u32 u = 0; u < XENT_UNROLL; ++u)
            if (j0 + u * BLOCK < vocab) x[j0 + u * BLOCK] = narrow<T>(scale * cpu_exp(v[u] - lse));
    }
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
                                        u32 seq, u32 half, float sign, const u32* pos) {                   \
        rope<T>(x, cos_t, sin_t, rows, width, seq, half, sign, pos);                                       \
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
    extern "C" __global__ void scale_rows_##S(T* x, const T* w, u64 n, u64 width) {                     \
        scale_rows<T>(x, w, n, width);                                                                   \
    }                                                                                                    \
    extern "C" __global__ void scatter_add_rows_##S(const T* src, const u32* rows, const T* w, T* dst,   \
                                                    u64 n, u64 width) {                                  \
        scatter_add_rows<T>(src, rows, w, dst, n, width);                                                \
    }                                                                                                    \
    extern "C" __global__ void row_dots_##S(const T* a, const T* b, float* out, u32 width) {             \
        row_dots<T>(a, b, out, width);                                                                   \
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

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
// The tensor-core attention kernels for heads D wide, streaming NS rows at a time: the pairs
// `tensor_core_keys` in attention.rs chooses (a launch with another pair traps).
#define DEFINE_TC_KERNELS(D, NS)                                                                         \
    extern "C" __global__ void attn_tc_fwd_d##D(const bf16* q, const bf16* k, const bf16* v, bf16* out,  \
                                                float* lse, Attn a) {                                    \
        attn_tc_fwd<D / 16, NS / 8>(q, k, v, out, lse, a);                                               \
    }                                                                                                    \
    extern "C" __global__ void attn_tc_dq_d##D(const bf16* q, const bf16* k, const bf16* v,              \
                                               const bf16* dout, const float* lse, const float* delta,   \
                                               bf16* dq, Attn a) {                                       \
        attn_tc_dq<D / 16, NS / 8>(q, k, v, dout, lse, delta, dq, a);                                    \
    }                                                                                                    \
    extern "C" __global__ void attn_tc_dkv_d##D(const bf16* q, const bf16* k, const bf16* v,             \
                                                const bf16* dout, const float* lse, const float* delta,  \
                                                bf16* dk, bf16* dv, Attn a) {                            \
        attn_tc_dkv<D / 16, NS / 8>(q, k, v, dout, lse, delta, dk, dv, a);                               \
    }

DEFINE_TC_KERNELS(16, 64)
DEFINE_TC_KERNELS(32, 64)
DEFINE_TC_KERNELS(48, 64)
DEFINE_TC_KERNELS(64, 64)
DEFINE_TC_KERNELS(80, 32)
DEFINE_TC_KERNELS(96, 32)
DEFINE_TC_KERNELS(112, 32)
DEFINE_TC_KERNELS(128, 32)
#endif

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

// The gradient norm's partial sums of up to SUMSQ_TENSORS tensors in one launch. The list's
// chunks are numbered across its tensors (tensor t's are first[t] .. first[t + 1]); partial[c] =
// the sum of x^2 (in f64, in order) over chunk c's `chunk` elements: the CPU's partials. The
// threads of a block take consecutive chunks and stage SUMSQ_TILE elements of each at a time
// in shared memory, a warp loading one chunk's tile per instruction (coalesced), then each adds
// its own chunk's in order. Elements past a tensor's end load as +0: their squares add nothing
// to a sum of squares, which starts at +0, so the bits are those of the plain loop.
#define SUMSQ_TENSORS 64
#define SUMSQ_TILE 32
struct SumsqList {
    const float* x[SUMSQ_TENSORS];
    u64 n[SUMSQ_TENSORS];
    u64 first[SUMSQ_TENSORS + 1];
    u32 count;
};

extern "C" __global__ void sumsq_chunks(SumsqList l, double* partial, u64 chunk) {
    __shared__ float tile[BLOCK][SUMSQ_TILE + 1];
    __shared__ const float* base[BLOCK];
    __shared__ u64 len[BLOCK];
    u64 c = global_index();
    const float* mine = nullptr;
    u64 m = 0;
    if (c < l.first[l.count]) {
        u32 t = 0;
        while (c >= l.first[t + 1]) ++t;
        u64 start = (c - l.first[t]) * chunk;
        mine = l.x[t] + start;
        m = l.n[t] - start < chunk ? l.n[t] - start : chunk;
    }
    base[threadIdx.x] = mine;
    len[threadIdx.x] = m;
    __syncthreads();
    u32 lane = threadIdx.x % 32;
    double s = 0.0;
    for (u64 at = 0; at < chunk; at += SUMSQ_TILE) {
        for (u32 r = threadIdx.x / 32; r < BLOCK; r += BLOCK / 32) {
            u64 i = at + lane;
            tile[r][lane] = i < len[r] ? base[r][i] : 0.0f;
        }
        __syncthreads();
        for (u32 k = 0; k < SUMSQ_TILE; ++k) {
            double v = tile[threadIdx.x][k];
            s += v * v;
        }
        __syncthreads();
    }
    if (m > 0) partial[c] = s;
}

extern "C" __global__ void scale_f32(float* x, u64 n, float coef) {
    u64 i = global_index();
    if (i < n) x[i] *= coef;
}
