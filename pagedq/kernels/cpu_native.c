/* Paged attention for the CPU, reading the KV blocks in place (pagedq/kernels/cpu_native.py builds and loads it): decode,
   and short causal query chunks (speculative verify rows, <= 17 queries after a cached prefix).

   Same math as kernels.reference.paged_decode_attention (and paged_prefill_attention for the chunks): one query
   per sequence over its context_len cached tokens (a chunk's query i sees context_len - q_len + i + 1 of them),
   scores and softmax and P.V in fp32 (bf16 is widened on load), the output rounded to the input dtype (bf16: to
   nearest even, as torch rounds). No torch headers, so it compiles in about two seconds.
   The attention variants, as the reference defines them: a sliding window (a query at position p sees keys
   p - window + 1 .. p; the walk starts at the task's first visible token, so blocks before every row's window
   are never read), a logit soft-cap (scores = softcap * tanh(scores / softcap)), and sinks (one logit per query
   head in the denominator: the running max and sum start at (sink, 1) instead of (-inf, 0), as if the sink were
   one more key whose value is zero).

   Layout (fixed for the project): k_cache, v_cache [num_blocks, block_size, Hkv, D] contiguous; token t of block
   b, head h at ((b * block_size + t) * Hkv + h) * D. query [S, Hq, D] with row strides q_seq, q_head (elements;
   the last dim contiguous); out [S, Hq, D] contiguous; block_tables [S, M] and context_lens [S] int32.

   One task per (sequence, KV head), spread over OpenMP threads: it walks the sequence's blocks TILE tokens at a
   time, scores them against all the head's G = Hq / Hkv query heads (each K and V row read once for all of
   them: GQA), then one max and rescale per tile and query head (online softmax), then accumulates P.V.
   Vectors are GCC/Clang vector extensions, not intrinsics: portable, and -march=native picks the width.
   No -ffast-math: the exp below is a polynomial of our own, and NaN/inf must propagate as in the reference. */

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 16

typedef float v8sf __attribute__((vector_size(32)));
typedef int32_t v8si __attribute__((vector_size(32)));

static inline v8sf load8(const float *p) {
    v8sf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8sf v) { memcpy(p, &v, sizeof v); }

static inline v8sf splat(float x) { return (v8sf){x, x, x, x, x, x, x, x}; }

static inline v8sf select8(v8si mask, v8sf a, v8sf b) {
    return (v8sf)(((v8si)a & mask) | ((v8si)b & ~mask));
}

static inline float hsum8(v8sf v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

/* exp for fp32 lanes (Cephes' expf: range reduction by ln 2, degree-6 polynomial; ~1 ulp). Lanes below -88.38
   (-inf included) give 0; NaN stays NaN (every comparison with it is false, so no clamp replaces it). */
static inline v8sf exp8(v8sf x) {
    const v8si under = x < splat(-88.3762626647949f);
    x = select8(x > splat(88.3762626647949f), splat(88.3762626647949f), x);
    x = select8(under, splat(-88.3762626647949f), x);
    v8sf fx = x * splat(1.44269504088896341f) + splat(0.5f);
    v8sf n = __builtin_convertvector(__builtin_convertvector(fx, v8si), v8sf); /* trunc, then floor: */
    n += __builtin_convertvector(n > fx, v8sf);                               /* true is -1 */
    x = x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
    v8sf y = splat(1.9875691500e-4f);
    y = y * x + splat(1.3981999507e-3f);
    y = y * x + splat(8.3334519073e-3f);
    y = y * x + splat(4.1665795894e-2f);
    y = y * x + splat(1.6666665459e-1f);
    y = y * x + splat(5.0000001201e-1f);
    y = y * (x * x) + x + splat(1.0f);
    v8si pow2n = (__builtin_convertvector(n, v8si) + 127) << 23;
    return (v8sf)((v8si)(y * (v8sf)pow2n) & ~under);
}

static inline float dot(const float *a, const float *b, int d_size) {
    v8sf s0 = splat(0.0f), s1 = splat(0.0f), s2 = splat(0.0f), s3 = splat(0.0f); /* four chains: FMA latency */
    int d = 0;
    for (; d + 32 <= d_size; d += 32) {
        s0 += load8(a + d) * load8(b + d);
        s1 += load8(a + d + 8) * load8(b + d + 8);
        s2 += load8(a + d + 16) * load8(b + d + 16);
        s3 += load8(a + d + 24) * load8(b + d + 24);
    }
    for (; d + 8 <= d_size; d += 8) s0 += load8(a + d) * load8(b + d);
    float sum = hsum8((s0 + s1) + (s2 + s3));
    for (; d < d_size; d++) sum += a[d] * b[d];
    return sum;
}

#define CHUNK 64 /* floats of acc one register-blocked pass keeps in registers: 8 vectors of 8 */

/* acc[0:d_size] = acc * alpha + sum over t < n of p[t] * v[t * stride:]. Each CHUNK of acc stays in registers
   over the tile's tokens: eight independent FMA chains instead of one per vector. */
static inline void accumulate(float *acc, float alpha, const float *p, const float *v, ptrdiff_t stride, int n,
                              int d_size) {
    int d = 0;
    for (; d + CHUNK <= d_size; d += CHUNK) {
        v8sf a[CHUNK / 8];
        for (int c = 0; c < CHUNK / 8; c++) a[c] = load8(acc + d + 8 * c) * splat(alpha);
        for (int t = 0; t < n; t++) {
            const v8sf weight = splat(p[t]);
            for (int c = 0; c < CHUNK / 8; c++) a[c] += weight * load8(v + t * stride + d + 8 * c);
        }
        for (int c = 0; c < CHUNK / 8; c++) store8(acc + d + 8 * c, a[c]);
    }
    for (; d + 8 <= d_size; d += 8) {
        v8sf a = load8(acc + d) * splat(alpha);
        for (int t = 0; t < n; t++) a += splat(p[t]) * load8(v + t * stride + d);
        store8(acc + d, a);
    }
    for (; d < d_size; d++) {
        float a = acc[d] * alpha;
        for (int t = 0; t < n; t++) a += p[t] * v[t * stride + d];
        acc[d] = a;
    }
}

/* Running state of one task (one per (sequence, KV head)), rows = its queries x the KV head's G query heads
   (row i * G + g): q [rows][D] (fp32), acc [rows][D], running max m and sum l [rows], and the tokens
   [first[r], limit[r]) row r sees (decode: the whole context, or its window; query i of a chunk of q_len: up to
   context_len - q_len + i + 1). softcap 0: none. */
typedef struct {
    const float *q;
    float *acc, *m, *l;
    const int *first, *limit;
    int rows;
    float scale, softcap;
} State;

/* One tile of n <= TILE tokens from token `start`, K/V rows `stride` floats apart: per row, the scores of the
   tokens it sees, one max and rescale, P.V. A row that sees none of the tile is left as it is. */
static inline __attribute__((always_inline)) void attend_tile(State *st, const float *k, const float *v,
                                                              ptrdiff_t stride, int start, int n, int d_size,
                                                              int variant) {
    float p[TILE] __attribute__((aligned(32)));
    for (int r = 0; r < st->rows; r++) {
        const int seen = st->limit[r] - start < n ? st->limit[r] - start : n;
        const int skip = variant && st->first[r] > start ? st->first[r] - start : 0; /* before the row's window */
        if (seen <= skip) continue;
        const float *q = st->q + (ptrdiff_t)r * d_size;
        float block_max = -INFINITY;
        for (int t = 0; t < skip; t++) p[t] = -INFINITY;
        for (int t = skip; t < seen; t++) {
            float score = dot(q, k + t * stride, d_size) * st->scale;
            if (variant && st->softcap != 0.0f) score = st->softcap * tanhf(score / st->softcap);
            p[t] = score;
            block_max = score > block_max ? score : block_max;
        }
        for (int t = seen; t < TILE; t++) p[t] = -INFINITY;
        float m_new = block_max > st->m[r] ? block_max : st->m[r];
        float alpha = expf(st->m[r] - m_new); /* 0 on the first tile (m = -inf) */
        v8sf sum = splat(0.0f);
        for (int t = 0; t < TILE; t += 8) {
            v8sf e = exp8(load8(p + t) - splat(m_new));
            store8(p + t, e);
            sum += e;
        }
        st->l[r] = st->l[r] * alpha + hsum8(sum);
        st->m[r] = m_new;
        accumulate(st->acc + (ptrdiff_t)r * d_size, alpha, p, v, stride, seen, d_size);
    }
}

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, NaN kept quiet: torch's rounding */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (f != f) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

/* n rows of d_size bf16 values, `stride` elements apart, widened into dst [n][d_size]. */
static inline void widen_rows(const uint16_t *src, ptrdiff_t stride, int n, int d_size, float *dst) {
    for (int t = 0; t < n; t++)
        for (int d = 0; d < d_size; d++) dst[t * d_size + d] = bf16_to_f32(src[t * stride + d]);
}

typedef struct {
    const void *q, *k, *v;
    int64_t q_seq, q_head, out_seq, out_head, num_blocks;
    int block_size, num_kv_heads, head_dim, num_q_heads, table_width, bf16;
    const int32_t *tables, *lens, *q_starts, *q_lens;
    float scale, softcap;
    int window;
    const float *sinks; /* [num_q_heads] or NULL */
    void *out;
} Args;

/* Prefetch the K/V rows of the tile starting at token `start`: a sequence's blocks lie anywhere in the pool, so
   the hardware prefetcher cannot guess the next one, and the current tile's arithmetic hides the fetch. */
static inline void prefetch_tile(const Args *a, int seq, int head, int start, int len, ptrdiff_t row) {
    if (start >= len) return;
    const int bs = a->block_size, n = len - start < TILE ? len - start : TILE;
    const int32_t block = a->tables[(ptrdiff_t)seq * a->table_width + start / bs];
    if (block < 0 || block >= a->num_blocks) return;
    const size_t elem = a->bf16 ? 2 : 4, bytes = (size_t)a->head_dim * elem;
    const ptrdiff_t base = ((ptrdiff_t)block * bs + start % bs) * row + (ptrdiff_t)head * a->head_dim;
    for (int t = 0; t < n && start % bs + t < bs; t++)
        for (size_t b = 0; b < bytes; b += 64) {
            __builtin_prefetch((const char *)a->k + (base + t * row) * elem + b);
            __builtin_prefetch((const char *)a->v + (base + t * row) * elem + b);
        }
}

/* Walk sequence seq's context [from, len) for KV head `head`, TILE tokens at a time (a tile never crosses a
   block). */
static inline __attribute__((always_inline)) int walk_context(const Args *a, State *st, int seq, int head, int from,
                                                              int len, float *kbuf, float *vbuf, int d_size,
                                                              int variant) {
    const int bs = a->block_size;
    const ptrdiff_t row = (ptrdiff_t)a->num_kv_heads * d_size;
    for (int start = from, tile; start < len; start += tile) {
        const int32_t block = a->tables[(ptrdiff_t)seq * a->table_width + start / bs];
        if (block < 0 || block >= a->num_blocks) return 1;
        const int n = len - start < TILE ? len - start : TILE, in_block = start % bs;
        tile = n < bs - in_block ? n : bs - in_block;
        const ptrdiff_t base = ((ptrdiff_t)block * bs + in_block) * row + (ptrdiff_t)head * d_size;
        prefetch_tile(a, seq, head, start + tile, len, row);
        if (a->bf16) {
            widen_rows((const uint16_t *)a->k + base, row, tile, d_size, kbuf);
            widen_rows((const uint16_t *)a->v + base, row, tile, d_size, vbuf);
            attend_tile(st, kbuf, vbuf, d_size, start, tile, d_size, variant);
        } else {
            attend_tile(st, (const float *)a->k + base, (const float *)a->v + base, row, start, tile, d_size, variant);
        }
    }
    return 0;
}

/* Task (seq, head): seq's queries (decode: query row seq alone; a chunk: rows q_starts[seq] + [0, q_lens[seq]))
   with the head's query heads, d_size = a->head_dim (a constant from the fast paths' callers). Returns 1 if a
   block index within the context is out of range (nothing is read from it), 3 if memory ran out. */
static inline __attribute__((always_inline)) int run_task(const Args *a, int seq, int head, int d_size,
                                                          int variant) {
    const int groups = a->num_q_heads / a->num_kv_heads;
    const int first = a->q_starts ? a->q_starts[seq] : seq, queries = a->q_starts ? a->q_lens[seq] : 1;
    const int rows = queries * groups, wide = a->bf16 ? TILE * d_size : 0;
    int len = a->lens[seq];
    if (len > a->table_width * a->block_size) len = a->table_width * a->block_size; /* as the reference's mask */
    /* q, acc [rows][D]; m, l [rows]; kbuf, vbuf [TILE][D] (bf16 only): a chunk's rows may not fit a stack */
    float *buf = malloc(sizeof(float) * ((size_t)rows * (2 * d_size + 2) + 2 * (size_t)wide));
    int *limit = malloc(sizeof(int) * 2 * (size_t)rows), *seen_from = limit + rows;
    if (!buf || !limit) return free(buf), free(limit), 3;
    float *q = buf, *acc = q + rows * d_size, *m = acc + rows * d_size, *l = m + rows, *kbuf = l + rows;
    int from = len;
    for (int r = 0; r < rows; r++) {
        const int i = r / groups, g = r % groups, q_head = head * groups + g;
        const ptrdiff_t off = (first + i) * a->q_seq + (ptrdiff_t)q_head * a->q_head;
        for (int d = 0; d < d_size; d++)
            q[r * d_size + d] = a->bf16 ? bf16_to_f32(((const uint16_t *)a->q)[off + d]) : ((const float *)a->q)[off + d];
        m[r] = a->sinks ? a->sinks[q_head] : -INFINITY, l[r] = a->sinks ? 1.0f : 0.0f;
        limit[r] = a->lens[seq] - queries + i + 1;
        seen_from[r] = a->window > 0 && limit[r] > a->window ? limit[r] - a->window : 0;
        from = seen_from[r] < from ? seen_from[r] : from;
    }
    memset(acc, 0, sizeof(float) * (size_t)rows * d_size);
    State st = {q, acc, m, l, seen_from, limit, rows, a->scale, a->softcap};
    const int status = walk_context(a, &st, seq, head, from, len, kbuf, kbuf + wide, d_size, variant);
    for (int r = 0; status == 0 && r < rows; r++) {
        const int i = r / groups, g = r % groups;
        const ptrdiff_t off = (first + i) * a->out_seq + (ptrdiff_t)(head * groups + g) * a->out_head;
        for (int d = 0; d < d_size; d++) {
            const float o = acc[r * d_size + d] / l[r]; /* l = 0 (no context) gives NaN, as the reference */
            if (a->bf16)
                ((uint16_t *)a->out)[off + d] = f32_to_bf16(o);
            else
                ((float *)a->out)[off + d] = o;
        }
    }
    free(buf), free(limit);
    return status;
}

static int run_task_any(const Args *a, int seq, int head) {
    /* a soft-cap or a window compiles its own loops: the plain ones stay as they were */
    const int variant = a->softcap != 0.0f || a->window > 0;
    switch (a->head_dim) { /* constant head dims: the loops over D unroll and stay in registers */
    case 64: return variant ? run_task(a, seq, head, 64, 1) : run_task(a, seq, head, 64, 0);
    case 128: return variant ? run_task(a, seq, head, 128, 1) : run_task(a, seq, head, 128, 0);
    default: return run_task(a, seq, head, a->head_dim, 1);
    }
}

/* Paged attention of num_seqs query groups over their contexts: decode (q_starts = NULL: query row s of
   sequence s, one token at position context_lens[s] - 1) or short chunks (rows q_starts[s] + [0, q_lens[s]) of
   query, query i at position context_lens[s] - q_lens[s] + i, seeing the keys up to it), with a sliding window
   (0: none), a soft-cap (0: none) and sinks (NULL: none; else [num_q_heads] fp32). Strides in elements, the head
   dim contiguous. Returns 0; 1 if a block table entry within a context is out of range, 2 if the
   shapes are inconsistent, 3 if memory ran out. */
int pagedq_paged_attention(const void *query, int64_t q_seq, int64_t q_head, const void *k_cache,
                           const void *v_cache, int64_t num_blocks, int block_size, int num_kv_heads, int head_dim,
                           int num_seqs, int num_q_heads, const int32_t *block_tables, int table_width,
                           const int32_t *context_lens, const int32_t *q_starts, const int32_t *q_lens, float scale,
                           void *out, int64_t out_seq, int64_t out_head, int bf16, int num_threads, int window,
                           float softcap, const float *sinks) {
    if (num_kv_heads <= 0 || num_q_heads % num_kv_heads || block_size <= 0 || head_dim <= 0 || num_seqs < 0 ||
        (q_starts == NULL) != (q_lens == NULL) || window < 0 || softcap < 0.0f)
        return 2;
    const Args a = {query, k_cache, v_cache, q_seq, q_head, out_seq, out_head, num_blocks, block_size,
                    num_kv_heads, head_dim, num_q_heads, table_width, bf16, block_tables, context_lens, q_starts,
                    q_lens, scale, softcap, window, sinks, out};
    const int64_t tasks = (int64_t)num_seqs * num_kv_heads;
    int failed = 0;
#pragma omp parallel for schedule(dynamic) num_threads(num_threads)
    for (int64_t task = 0; task < tasks; task++) {
        const int status = run_task_any(&a, (int)(task / num_kv_heads), (int)(task % num_kv_heads));
        if (status) {
#pragma omp atomic write
            failed = status;
        }
    }
    return failed;
}
