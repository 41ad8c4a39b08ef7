// Runs kernels of kernels.cu (included as `kernels.cpp`, made host C++ by cuda_host.rs) on
// inputs from a file and writes their outputs to another, for engine/tests/cuda_host.rs.
//
//   driver attention ELEM BATCH SEQ HEADS KV_HEADS D FWD_QUERIES FWD_KEYS BACKWARD IN OUT
//     IN: q, k, v, dout; OUT: out, lse, dq, dk, dv (the forward pass, delta, dq, dk/dv)
//   driver dropout ELEM N KEY THRESHOLD SHIFT SCALE IN OUT
//     IN: x, y, dout; OUT: x + dropout(y), its gradient for y
//   driver rmsnorm ELEM ROWS H EPS IN OUT
//     IN: x, w, dy, dx; OUT: y, rinv (f32), dx + the gradient, dw (f32, from zeros)
//   driver rope ELEM ROWS WIDTH SEQ HALF POSITIONS IN OUT
//     IN: x, cos (f32), sin (f32); OUT: x rotated, then that rotated back
//   driver swiglu ELEM N IN OUT
//     IN: gate, up, dact; OUT: act, dgate, dup
// ELEM is f32 or bf16; arrays are little-endian, back to back.
#include "emulator.h"
#include "kernels.cpp"
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

static unsigned blocks_of(size_t n) { return (unsigned)((n + THREADS - 1) / THREADS); }

template <typename T> void attention(char** a) {
    unsigned batch = std::stoul(a[0]), seq = std::stoul(a[1]), heads = std::stoul(a[2]),
             kv = std::stoul(a[3]), d = std::stoul(a[4]), fq = std::stoul(a[5]), fk = std::stoul(a[6]),
             bt = std::stoul(a[7]);
    Reader r{std::ifstream(a[8], std::ios::binary)};
    size_t qn = (size_t)batch * seq * heads * d, kn = (size_t)batch * seq * kv * d, ln = (size_t)batch * heads * seq;
    auto q = r.read<T>(qn), k = r.read<T>(kn), v = r.read<T>(kn), dout = r.read<T>(qn);
    float scale = 1.0f / std::sqrt((float)d);
    Attn fwd{batch, seq, heads, kv, d, scale, fq, fk};
    Attn bwd{batch, seq, heads, kv, d, scale, bt, bt};
    std::vector<T> out(qn), dq(qn), dk(kn), dv(kn);
    std::vector<float> lse(ln), delta(ln);
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
    Writer w{std::ofstream(a[9], std::ios::binary)};
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
    std::vector<T> out(n), dy(n);
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
    std::vector<T> y(n);
    std::vector<float> rinv(rows), dw(h);
    launch({rows, 1, 1}, THREADS, 0, [&] { rmsnorm_fwd<T>(x.data(), w.data(), y.data(), rinv.data(), h, eps); });
    launch({rows, 1, 1}, THREADS, 0, [&] { rmsnorm_bwd_dx<T>(dy.data(), x.data(), w.data(), rinv.data(), dx.data(), h); });
    launch({blocks_of(h), 1, 1}, THREADS, 0, [&] { rmsnorm_bwd_dw<T>(dy.data(), x.data(), rinv.data(), dw.data(), rows, h); });
    Writer out{std::ofstream(a[4], std::ios::binary)};
    out.write(y);
    out.write(rinv);
    out.write(dx);
    out.write(dw);
}

template <typename T> void rope_both_ways(char** a) {
    unsigned rows = std::stoul(a[0]), width = std::stoul(a[1]), seq = std::stoul(a[2]), half = std::stoul(a[3]),
             positions = std::stoul(a[4]);
    Reader r{std::ifstream(a[5], std::ios::binary)};
    size_t n = (size_t)rows * width;
    auto x = r.read<T>(n);
    auto cos_t = r.read<float>((size_t)positions * half), sin_t = r.read<float>((size_t)positions * half);
    Writer out{std::ofstream(a[6], std::ios::binary)};
    for (float sign : {1.0f, -1.0f}) {
        launch({blocks_of(n / 2), 1, 1}, THREADS, 0,
               [&] { rope<T>(x.data(), cos_t.data(), sin_t.data(), rows, width, seq, half, sign); });
        out.write(x);
    }
}

template <typename T> void swiglu(char** a) {
    size_t n = std::stoull(a[0]);
    Reader r{std::ifstream(a[1], std::ios::binary)};
    auto gate = r.read<T>(n), up = r.read<T>(n), dact = r.read<T>(n);
    std::vector<T> act(n), dgate(n), dup(n);
    launch({blocks_of(n), 1, 1}, THREADS, 0, [&] { swiglu_fwd<T>(gate.data(), up.data(), act.data(), n); });
    launch({blocks_of(n), 1, 1}, THREADS, 0,
           [&] { swiglu_bwd<T>(dact.data(), gate.data(), up.data(), dgate.data(), dup.data(), n); });
    Writer out{std::ofstream(a[2], std::ios::binary)};
    out.write(act);
    out.write(dgate);
    out.write(dup);
}

int main(int argc, char** argv) {
    try {
        std::string cmd = argc > 2 ? argv[1] : "", elem = argc > 2 ? argv[2] : "";
        if (cmd == "attention" && argc == 13) {
            elem == "bf16" ? attention<bf16>(argv + 3) : attention<float>(argv + 3);
        } else if (cmd == "dropout" && argc == 10) {
            elem == "bf16" ? dropout<bf16>(argv + 3) : dropout<float>(argv + 3);
        } else if (cmd == "rmsnorm" && argc == 8) {
            elem == "bf16" ? rmsnorm<bf16>(argv + 3) : rmsnorm<float>(argv + 3);
        } else if (cmd == "rope" && argc == 10) {
            elem == "bf16" ? rope_both_ways<bf16>(argv + 3) : rope_both_ways<float>(argv + 3);
        } else if (cmd == "swiglu" && argc == 6) {
            elem == "bf16" ? swiglu<bf16>(argv + 3) : swiglu<float>(argv + 3);
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
