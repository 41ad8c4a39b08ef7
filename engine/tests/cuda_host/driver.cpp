// Runs kernels of kernels.cu (included as `kernels.cpp`, made host C++ by cuda_host.rs) on
// inputs from a file and writes their outputs to another, for engine/tests/cuda_host.rs.
//
//   driver attention ELEM BATCH SEQ HEADS KV_HEADS D FWD_QUERIES FWD_KEYS BACKWARD PACKED IN OUT
//     IN: q, k, v, dout, and where PACKED is 1 the positions (u32); OUT: out, lse, dq, dk, dv
//     (the forward pass, delta, dq, dk/dv)
//   driver attention-tc bf16 BATCH SEQ HEADS KV_HEADS D KEYS PACKED IN OUT
//     the tensor-core kernels for heads D wide, streaming KEYS rows at a time; IN, OUT as above
//   driver dropout ELEM N KEY THRESHOLD SHIFT SCALE IN OUT
//     IN: x, y, dout; OUT: x + dropout(y), its gradient for y
//   driver rmsnorm ELEM ROWS H EPS IN OUT
//     IN: x, w, dy, dx; OUT: y, rinv (f32), dx + the gradient, dw (f32, from zeros)
//   driver rope ELEM ROWS WIDTH SEQ HALF POSITIONS PACKED IN OUT
//     IN: x, cos (f32), sin (f32), and where PACKED is 1 each row's position (u32); OUT: x
//     rotated, then that rotated back
//   driver bias ELEM ROWS WIDTH IN OUT
//     IN: y, b, dy; OUT: y + b per row, the bias gradient (f32, from zeros)
//   driver swiglu ELEM N IN OUT
//     IN: gate, up, dact; OUT: act, dgate, dup
//   driver embedding ELEM ROWS WIDTH VOCAB IN OUT
//     IN: table, ids (u32), dout; OUT: the rows of table, dtable (f32, from zeros)
//   driver xent ELEM ROWS VOCAB SCALE IN OUT
//     IN: logits, labels (i64); OUT: the logits' gradient, row losses (f32)
//   driver sumsq f32 CHUNK LENGTHS IN OUT
//     IN: tensors of the comma-separated LENGTHS; OUT: their sum-of-squares partials (f64)
//   driver optimizer f32 N CHUNK DECAY ONE_MINUS_B1 B2 ONE_MINUS_B2 EPS STEP_SIZE BC2_SQRT IN OUT
//     IN: p, g, m, v; OUT: p, m, v after AdamW, sum-of-squares partials of g (f64), bf16 of p,
//     g scaled by 0.375 (clipping)
// ELEM is f32 or bf16; arrays are little-endian, back to back.
#include "emulator.h"
#include "kernels.cpp"
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <stdexcept>
#include <string>

static const unsigned THREADS = 256;

struct Reader {
    std::ifstream in;
    template <typename T> std::vector<T> read(size_t n) {
        std::vector<T> v(n);
        in.read(reinterpret_cast<char*>(v.data()), n * sizeof(T));
        if (!in) throw std::runtime_error("input file too short");
        return v;
    }
};

struct Writer {
    std::ofstream out;
    template <typename T> void write(const std::vector<T>& v) {
        out.write(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
    }
};

// An output buffer of n elements filled with NaN, as the GPU may hand out memory an output
// kernel must write in full (Device::uninit): a kernel that reads it, or skips an element,
// shows as NaN in the comparison.
template <typename T> std::vector<T> poisoned(size_t n) { return std::vector<T>(n, (T)0xffffu); }
template <> std::vector<float> poisoned<float>(size_t n) { return std::vector<float>(n, std::nanf("")); }

static unsigned blocks_of(size_t n) { return (unsigned)((n + THREADS - 1) / THREADS); }

// A packed batch's n positions from `r` where `packed` is "1", else none (an empty vector, whose
// data() the kernels see as no positions).
static std::vector<u32> positions_of(Reader& r, const char* packed, size_t n) {
    return std::string(packed) == "1" ? r.read<u32>(n) : std::vector<u32>();
}
static const u32* or_null(const std::vector<u32>& v) { return v.empty() ? nullptr : v.data(); }

template <typename T> void attention(char** a) {
    unsigned batch = std::stoul(a[0]), seq = std::stoul(a[1]), heads = std::stoul(a[2]),
             kv = std::stoul(a[3]), d = std::stoul(a[4]), fq = std::stoul(a[5]), fk = std::stoul(a[6]),
             bt = std::stoul(a[7]);
    Reader r{std::ifstream(a[9], std::ios::binary)};
    size_t qn = (size_t)batch * seq * heads * d, kn = (size_t)batch * seq * kv * d, ln = (size_t)batch * heads * seq;
    auto q = r.read<T>(qn), k = r.read<T>(kn), v = r.read<T>(kn), dout = r.read<T>(qn);
    auto pos = positions_of(r, a[8], (size_t)batch * seq);
    float scale = 1.0f / std::sqrt((float)d);
    Attn fwd{batch, seq, heads, kv, d, scale, fq, fk, or_null(pos)};
    Attn bwd{batch, seq, heads, kv, d, scale, bt, bt, or_null(pos)};
    auto out = poisoned<T>(qn), dq = poisoned<T>(qn), dk = poisoned<T>(kn), dv = poisoned<T>(kn);
    auto lse = poisoned<float>(ln), delta = poisoned<float>(ln);
    size_t ds = d + 1;
    launch({(seq + fq - 1) / fq, heads, batch}, THREADS, (fq * ds + 2 * fk * ds + fq * (fk + 1)) * 4,
           [&] { attn_fwd<T>(q.data(), k.data(), v.data(), out.data(), lse.data(), fwd); });
    launch({blocks_of(ln), 1, 1}, THREADS, 0, [&] { attn_delta<T>(out.data(), dout.data(), delta.data(), bwd); });
    launch({(seq + bt - 1) / bt, heads, batch}, THREADS, (2 * bt * ds + 2 * bt * ds + bt * (bt + 1)) * 4, [&] {
        attn_bwd_dq<T>(q.data(), k.data(), v.data(), dout.data(), lse.data(), delta.data(), dq.data(), bwd);
    });
    launch({(seq + bt - 1) / bt, kv, batch}, THREADS, (4 * bt * ds + 2 * bt * (bt + 1) + 2 * bt) * 4, [&] {
        attn_bwd_dkv<T>(q.data(), k.data(), v.data(), dout.data(), lse.data(), delta.data(), dk.data(), dv.data(), bwd);
    });
    Writer w{std::ofstream(a[10], std::ios::binary)};
    w.write(out);
    w.write(lse);
    w.write(dq);
    w.write(dk);
    w.write(dv);
}

// The tensor-core attention kernels of each head width, as kernels.cu defines them.
struct TcKernels {
    unsigned d;
    void (*fwd)(const bf16*, const bf16*, const bf16*, bf16*, float*, Attn);
    void (*dq)(const bf16*, const bf16*, const bf16*, const bf16*, const float*, const float*, bf16*, Attn);
    void (*dkv)(const bf16*, const bf16*, const bf16*, const bf16*, const float*, const float*, bf16*, bf16*, Attn);
};
#define TC_ENTRY(D) {D, attn_tc_fwd_d##D, attn_tc_dq_d##D, attn_tc_dkv_d##D}
static const TcKernels TC_KERNELS[] = {TC_ENTRY(16), TC_ENTRY(32),  TC_ENTRY(48),  TC_ENTRY(64),
                                       TC_ENTRY(80), TC_ENTRY(96), TC_ENTRY(112), TC_ENTRY(128)};

void attention_tc(char** a) {
    unsigned batch = std::stoul(a[0]), seq = std::stoul(a[1]), heads = std::stoul(a[2]),
             kv = std::stoul(a[3]), d = std::stoul(a[4]), keys = std::stoul(a[5]);
    auto tc = std::find_if(std::begin(TC_KERNELS), std::end(TC_KERNELS), [&](auto& t) { return t.d == d; });
    if (tc == std::end(TC_KERNELS)) throw std::runtime_error("no tensor-core kernels for this head width");
    Reader r{std::ifstream(a[7], std::ios::binary)};
    size_t qn = (size_t)batch * seq * heads * d, kn = (size_t)batch * seq * kv * d, ln = (size_t)batch * heads * seq;
    auto q = r.read<bf16>(qn), k = r.read<bf16>(kn), v = r.read<bf16>(kn), dout = r.read<bf16>(qn);
    auto pos = positions_of(r, a[6], (size_t)batch * seq);
    Attn at{batch, seq, heads, kv, d, 1.0f / std::sqrt((float)d), TC_ROWS, keys, or_null(pos)};
    auto out = poisoned<bf16>(qn), dq = poisoned<bf16>(qn), dk = poisoned<bf16>(kn), dv = poisoned<bf16>(kn);
    auto lse = poisoned<float>(ln), delta = poisoned<float>(ln);
    size_t shared = 4 * keys * (d + TC_PAD) * sizeof(bf16);
    unsigned tiles = (seq + TC_ROWS - 1) / TC_ROWS;
    launch({tiles, heads, batch}, TC_THREADS, shared,
           [&] { tc->fwd(q.data(), k.data(), v.data(), out.data(), lse.data(), at); });
    launch({blocks_of(ln), 1, 1}, THREADS, 0, [&] { attn_delta<bf16>(out.data(), dout.data(), delta.data(), at); });
    launch({tiles, heads, batch}, TC_THREADS, shared,
           [&] { tc->dq(q.data(), k.data(), v.data(), dout.data(), lse.data(), delta.data(), dq.data(), at); });
    launch({tiles, kv, batch}, TC_THREADS, shared, [&] {
        tc->dkv(q.data(), k.data(), v.data(), dout.data(), lse.data(), delta.data(), dk.data(), dv.data(), at);
    });
    Writer w{std::ofstream(a[8], std::ios::binary)};
    w.write(out);
    w.write(lse);
    w.write(dq);
    w.write(dk);
    w.write(dv);
}

template <typename T> void dropout(char** a) {
    size_t n = std::stoull(a[0]);
    DropoutMask m{std::stoull(a[1]), std::stoull(a[2]), (u32)std::stoul(a[3]), std::stof(a[4])};
    Reader r{std::ifstream(a[5], std::ios::binary)};
    auto x = r.read<T>(n), y = r.read<T>(n), dout = r.read<T>(n);
    auto out = poisoned<T>(n), dy = poisoned<T>(n);
    launch({blocks_of(n), 1, 1}, THREADS, 0, [&] { dropout_add<T>(x.data(), y.data(), out.data(), n, m); });
    launch({blocks_of(n), 1, 1}, THREADS, 0, [&] { dropout_bwd<T>(dout.data(), dy.data(), n, m); });
    Writer w{std::ofstream(a[6], std::ios::binary)};
    w.write(out);
    w.write(dy);
}

template <typename T> void rmsnorm(char** a) {
    unsigned rows = std::stoul(a[0]), h = std::stoul(a[1]);
    float eps = std::stof(a[2]);
    Reader r{std::ifstream(a[3], std::ios::binary)};
    size_t n = (size_t)rows * h;
    auto x = r.read<T>(n), w = r.read<T>(h), dy = r.read<T>(n), dx = r.read<T>(n);
    auto y = poisoned<T>(n);
    auto rinv = poisoned<float>(rows);
    std::vector<float> dw(h);
    launch({rows, 1, 1}, THREADS, 0, [&] { rmsnorm_fwd<T>(x.data(), w.data(), y.data(), rinv.data(), h, eps); });
    launch({rows, 1, 1}, THREADS, 0, [&] { rmsnorm_bwd_dx<T>(dy.data(), x.data(), w.data(), rinv.data(), dx.data(), h); });
    launch({(h + 31) / 32, 1, 1}, DW_WARPS * 32, 0,
           [&] { rmsnorm_bwd_dw<T>(dy.data(), x.data(), rinv.data(), dw.data(), rows, h); });
    Writer out{std::ofstream(a[4], std::ios::binary)};
    out.write(y);
    out.write(rinv);
    out.write(dx);
    out.write(dw);
}

template <typename T> void rope_both_ways(char** a) {
    unsigned rows = std::stoul(a[0]), width = std::stoul(a[1]), seq = std::stoul(a[2]), half = std::stoul(a[3]),
             positions = std::stoul(a[4]);
    Reader r{std::ifstream(a[6], std::ios::binary)};
    size_t n = (size_t)rows * width;
    auto x = r.read<T>(n);
    auto cos_t = r.read<float>((size_t)positions * half), sin_t = r.read<float>((size_t)positions * half);
    auto pos = positions_of(r, a[5], rows);
    Writer out{std::ofstream(a[7], std::ios::binary)};
    for (float sign : {1.0f, -1.0f}) {
        launch({blocks_of(n / 2), 1, 1}, THREADS, 0, [&] {
            rope<T>(x.data(), cos_t.data(), sin_t.data(), rows, width, seq, half, sign, or_null(pos));
        });
        out.write(x);
    }
}

template <typename T> void bias(char** a) {
    size_t rows = std::stoull(a[0]), width = std::stoull(a[1]), n = rows * width;
    Reader r{std::ifstream(a[2], std::ios::binary)};
    auto y = r.read<T>(n), b = r.read<T>(width), dy = r.read<T>(n);
    std::vector<float> db(width, 0.0f);
    launch({blocks_of(n), 1, 1}, THREADS, 0, [&] { add_bias<T>(y.data(), b.data(), n, width); });
    launch({blocks_of(width), 1, 1}, THREADS, 0, [&] { bias_grad<T>(dy.data(), db.data(), rows, width); });
    Writer out{std::ofstream(a[3], std::ios::binary)};
    out.write(y);
    out.write(db);
}

// A MoE layer's row kernels: the rows of `src` scaled by `w`; added, weighted and not, into the
// rows `rows` of `dst`; and the dot products of the rows of `a` and `b`.
template <typename T> void moe_rows(char** a) {
    size_t n = std::stoull(a[0]), width = std::stoull(a[1]), dst_rows = std::stoull(a[2]), len = n * width;
    Reader r{std::ifstream(a[3], std::ios::binary)};
    auto src = r.read<T>(len);
    auto rows = r.read<u32>(n);
    auto w = r.read<T>(n), dst = r.read<T>(dst_rows * width);
    auto x = r.read<T>(len), y = r.read<T>(len);
    auto scaled = src, weighted = dst, plain = dst;
    std::vector<float> dots(n);
    launch({blocks_of(len), 1, 1}, THREADS, 0, [&] { scale_rows<T>(scaled.data(), w.data(), len, width); });
    launch({blocks_of(len), 1, 1}, THREADS, 0,
           [&] { scatter_add_rows<T>(src.data(), rows.data(), w.data(), weighted.data(), len, width); });
    launch({blocks_of(len), 1, 1}, THREADS, 0,
           [&] { scatter_add_rows<T>(src.data(), rows.data(), nullptr, plain.data(), len, width); });
    launch({(unsigned)n, 1, 1}, THREADS, 0, [&] { row_dots<T>(x.data(), y.data(), dots.data(), (u32)width); });
    Writer out{std::ofstream(a[4], std::ios::binary)};
    out.write(scaled);
    out.write(weighted);
    out.write(plain);
    out.write(dots);
}

template <typename T> void swiglu(char** a) {
    size_t n = std::stoull(a[0]);
    Reader r{std::ifstream(a[1], std::ios::binary)};
    auto gate = r.read<T>(n), up = r.read<T>(n), dact = r.read<T>(n);
    auto act = poisoned<T>(n), dgate = poisoned<T>(n), dup = poisoned<T>(n);
    launch({blocks_of(n), 1, 1}, THREADS, 0, [&] { swiglu_fwd<T>(gate.data(), up.data(), act.data(), n); });
    launch({blocks_of(n), 1, 1}, THREADS, 0,
           [&] { swiglu_bwd<T>(dact.data(), gate.data(), up.data(), dgate.data(), dup.data(), n); });
    Writer out{std::ofstream(a[2], std::ios::binary)};
    out.write(act);
    out.write(dgate);
    out.write(dup);
}

template <typename T> void embedding(char** a) {
    unsigned rows = std::stoul(a[0]), width = std::stoul(a[1]), vocab = std::stoul(a[2]);
    Reader r{std::ifstream(a[3], std::ios::binary)};
    auto table = r.read<T>((size_t)vocab * width);
    auto ids = r.read<u32>(rows);
    auto dout = r.read<T>((size_t)rows * width);
    auto out = poisoned<T>((size_t)rows * width);
    std::vector<float> dtable((size_t)vocab * width);
    launch({blocks_of(out.size()), 1, 1}, THREADS, 0,
           [&] { embedding_fwd<T>(table.data(), ids.data(), out.data(), rows, width); });
    // Positions grouped by id, as kernels.rs's embedding_backward groups them (padded).
    std::vector<u32> order(rows), distinct, starts;
    for (u32 p = 0; p < rows; ++p) order[p] = p;
    std::sort(order.begin(), order.end(), [&](u32 x, u32 y) { return std::make_pair(ids[x], x) < std::make_pair(ids[y], y); });
    for (u32 k = 0; k < rows; ++k)
        if (distinct.empty() || distinct.back() != ids[order[k]]) {
            distinct.push_back(ids[order[k]]);
            starts.push_back(k);
        }
    unsigned groups = distinct.size();
    starts.resize(rows + 1, rows);
    distinct.resize(rows, 0);
    launch({groups, 1, 1}, THREADS, 0, [&] {
        embedding_bwd<T>(dout.data(), order.data(), starts.data(), distinct.data(), dtable.data(), width);
    });
    Writer w{std::ofstream(a[4], std::ios::binary)};
    w.write(out);
    w.write(dtable);
}

template <typename T> void xent_rows(char** a) {
    unsigned rows = std::stoul(a[0]), vocab = std::stoul(a[1]);
    float scale = std::stof(a[2]);
    Reader r{std::ifstream(a[3], std::ios::binary)};
    auto logits = r.read<T>((size_t)rows * vocab);
    auto labels = r.read<long long>(rows);
    std::vector<float> loss(rows);
    launch({rows, 1, 1}, THREADS, 0, [&] { xent<T>(logits.data(), labels.data(), loss.data(), vocab, scale); });
    Writer w{std::ofstream(a[4], std::ios::binary)};
    w.write(logits);
    w.write(loss);
}

void optimizer(char** a) {
    size_t n = std::stoull(a[0]), chunk = std::stoull(a[1]);
    AdamWArgs args{std::stof(a[2]), std::stof(a[3]), std::stof(a[4]), std::stof(a[5]),
                   std::stof(a[6]), std::stof(a[7]), std::stof(a[8])};
    Reader r{std::ifstream(a[9], std::ios::binary)};
    auto p = r.read<float>(n), g = r.read<float>(n), m = r.read<float>(n), v = r.read<float>(n);
    size_t chunks = (n + chunk - 1) / chunk;
    std::vector<double> partial(chunks);
    std::vector<bf16> half(n);
    launch({blocks_of(n), 1, 1}, THREADS, 0, [&] { adamw(p.data(), g.data(), m.data(), v.data(), n, args); });
    SumsqList one{};
    one.x[0] = g.data();
    one.n[0] = n;
    one.first[1] = chunks;
    one.count = 1;
    launch({blocks_of(chunks), 1, 1}, THREADS, 0, [&] { sumsq_chunks(one, partial.data(), chunk); });
    launch({blocks_of(n), 1, 1}, THREADS, 0, [&] { f32_to_bf16(p.data(), half.data(), n); });
    launch({blocks_of(n), 1, 1}, THREADS, 0, [&] { scale_f32(g.data(), n, 0.375f); });
    Writer w{std::ofstream(a[10], std::ios::binary)};
    w.write(p);
    w.write(m);
    w.write(v);
    w.write(partial);
    w.write(half);
    w.write(g);
}

// The sum-of-squares partials of tensors of the comma-separated LENGTHS, in one list.
void sumsq(char** a) {
    size_t chunk = std::stoull(a[0]);
    std::vector<size_t> lengths;
    for (std::string rest = a[1]; !rest.empty();) {
        size_t comma = rest.find(',');
        lengths.push_back(std::stoull(rest.substr(0, comma)));
        rest = comma == std::string::npos ? "" : rest.substr(comma + 1);
    }
    if (lengths.size() > SUMSQ_TENSORS) throw std::runtime_error("more tensors than one list holds");
    Reader r{std::ifstream(a[2], std::ios::binary)};
    std::vector<std::vector<float>> xs;
    SumsqList list{};
    for (size_t t = 0; t < lengths.size(); ++t) {
        xs.push_back(r.read<float>(lengths[t]));
        list.n[t] = lengths[t];
        list.first[t + 1] = list.first[t] + (lengths[t] + chunk - 1) / chunk;
    }
    for (size_t t = 0; t < lengths.size(); ++t) list.x[t] = xs[t].data();
    list.count = (unsigned)lengths.size();
    std::vector<double> partial(list.first[list.count]);
    launch({blocks_of(partial.size()), 1, 1}, THREADS, 0, [&] { sumsq_chunks(list, partial.data(), chunk); });
    Writer w{std::ofstream(a[3], std::ios::binary)};
    w.write(partial);
}

int main(int argc, char** argv) {
    try {
        std::string cmd = argc > 2 ? argv[1] : "", elem = argc > 2 ? argv[2] : "";
        if (cmd == "attention" && argc == 14) {
            elem == "bf16" ? attention<bf16>(argv + 3) : attention<float>(argv + 3);
        } else if (cmd == "attention-tc" && elem == "bf16" && argc == 12) {
            attention_tc(argv + 3);
        } else if (cmd == "dropout" && argc == 10) {
            elem == "bf16" ? dropout<bf16>(argv + 3) : dropout<float>(argv + 3);
        } else if (cmd == "rmsnorm" && argc == 8) {
            elem == "bf16" ? rmsnorm<bf16>(argv + 3) : rmsnorm<float>(argv + 3);
        } else if (cmd == "rope" && argc == 11) {
            elem == "bf16" ? rope_both_ways<bf16>(argv + 3) : rope_both_ways<float>(argv + 3);
        } else if (cmd == "bias" && argc == 7) {
            elem == "bf16" ? bias<bf16>(argv + 3) : bias<float>(argv + 3);
        } else if (cmd == "moe_rows" && argc == 8) {
            elem == "bf16" ? moe_rows<bf16>(argv + 3) : moe_rows<float>(argv + 3);
        } else if (cmd == "swiglu" && argc == 6) {
            elem == "bf16" ? swiglu<bf16>(argv + 3) : swiglu<float>(argv + 3);
        } else if (cmd == "embedding" && argc == 8) {
            elem == "bf16" ? embedding<bf16>(argv + 3) : embedding<float>(argv + 3);
        } else if (cmd == "xent" && argc == 8) {
            elem == "bf16" ? xent_rows<bf16>(argv + 3) : xent_rows<float>(argv + 3);
        } else if (cmd == "sumsq" && elem == "f32" && argc == 7) {
            sumsq(argv + 3);
        } else if (cmd == "optimizer" && elem == "f32" && argc == 14) {
            optimizer(argv + 3);
        } else {
            std::fprintf(stderr, "usage: see the head of driver.cpp\n");
            return 2;
        }
    } catch (const std::exception& e) {
        std::fprintf(stderr, "driver: %s\n", e.what());
        return 1;
    }
    return 0;
}
