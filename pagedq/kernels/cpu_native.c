/* The CPU's native kernels (pagedq/kernels/cpu_native.py builds and loads them): paged attention reading the KV
   blocks in place, for decode and short causal query chunks (speculative verify rows, <= 17 queries after a cached
   prefix); and, in its own section at the end, the batched LoRA add for steps of a few tokens per adapter.

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

/* ---- Batched LoRA add (kernels.lora's lora_add; kernels.lora.grouped_lora_add calls it at decode size) ----

   y[t, off_n : off_n + out_n] += (x[t] @ lora_a[s, n].T) @ lora_b[s, n, :out_n].T for each token t of each
   adapter slot s and each slice n (off_n: the sum of the slices before n); base-model tokens are not touched.
   The same math as kernels.lora.lora_add: the product in fp32, added to y in fp32 and rounded once to y's dtype
   (bf16: to nearest even). Layout: x [T, in] and y [T, sum(out_sizes)] with row strides x_row, y_row (elements,
   rows contiguous); lora_a [S, N, R, in] and lora_b [S, N, max_out, R] contiguous; slot s's tokens are
   token_order[slot_starts[s] + i] for i < slot_lengths[s].

   One task per (slot, slice, group of LORA_TOKENS of the slot's tokens), so a slot's weights are read from memory
   once per group of its tokens; tasks write disjoint parts of y (other tokens or other columns). At decode a slot has
   a few tokens, so each weight row gets little arithmetic and the tasks stream memory the hardware prefetcher has
   not seen: the loops prefetch a few rows ahead. The expand takes 8 outputs at a time (their dot products over R
   summed across lanes together, sums8) where R is a multiple of 8, one at a time otherwise. */

#define LORA_TOKENS 8
#define LORA_MAX_RANK 1024
#define LORA_MAX_SLOTS 4096
#define LORA_PREFETCH_ROWS 2   /* A rows ahead of the shrink */
#define LORA_PREFETCH_OUTS 32  /* B rows ahead of the expand */

/* out[j] = the sum of v[j]'s lanes, for 8 vectors at once: a transpose folded into the adds. */
static inline v8sf sums8(const v8sf v[8]) {
    const v8si even = {0, 8, 2, 10, 4, 12, 6, 14}, odd = {1, 9, 3, 11, 5, 13, 7, 15};
    const v8si low2 = {0, 1, 8, 9, 4, 5, 12, 13}, high2 = {2, 3, 10, 11, 6, 7, 14, 15};
    const v8si low4 = {0, 1, 2, 3, 8, 9, 10, 11}, high4 = {4, 5, 6, 7, 12, 13, 14, 15};
    v8sf pairs[4], quads[2];
    for (int i = 0; i < 4; i++)
        pairs[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], even) + __builtin_shuffle(v[2 * i], v[2 * i + 1], odd);
    for (int i = 0; i < 2; i++)
        quads[i] = __builtin_shuffle(pairs[2 * i], pairs[2 * i + 1], low2) +
                   __builtin_shuffle(pairs[2 * i], pairs[2 * i + 1], high2);
    /* quads[0]: the partial sums of v[0..3] over lanes 0-3, then over lanes 4-7; quads[1]: the same of v[4..7] */
    return __builtin_shuffle(quads[0], quads[1], low4) + __builtin_shuffle(quads[0], quads[1], high4);
}

typedef struct {
    void *y;
    const void *x, *a, *b;
    int64_t y_row, x_row;
    int num_slices, rank, in_dim, max_out, bf16;
    const int32_t *out_sizes, *token_order, *slot_starts, *slot_lengths;
    int offsets[4];
} LoraArgs;

/* n values from element `at` of an fp32 or bf16 array, as fp32: in place for fp32, widened into scratch for bf16. */
static inline const float *as_f32(const void *base, int64_t at, int n, int bf16, float *scratch) {
    if (!bf16) return (const float *)base + at;
    widen_rows((const uint16_t *)base + at, 0, 1, n, scratch);
    return scratch;
}

static inline void prefetch_bytes(const void *base, int64_t at, int64_t n, int bf16) {
    const char *p = (const char *)base + at * (bf16 ? 2 : 4);
    for (int64_t i = 0; i < n * (bf16 ? 2 : 4); i += 64) __builtin_prefetch(p + i, 0, 3);
}

/* y[at : at + n] += delta[0 : n], in fp32, rounded once for bf16. */
static inline void add_delta(void *y, int64_t at, const float *delta, int n, int bf16) {
    if (bf16) {
        uint16_t *dst = (uint16_t *)y + at;
        for (int j = 0; j < n; j++) dst[j] = f32_to_bf16(bf16_to_f32(dst[j]) + delta[j]);
    } else {
        float *dst = (float *)y + at;
        for (int j = 0; j < n; j++) dst[j] += delta[j];
    }
}

/* One task: slice `slice` of slot `slot`'s tokens first .. first + LORA_TOKENS - 1 (fewer at the segment's end). */
static int lora_task(const LoraArgs *g, int slot, int slice, int first) {
    const int rank = g->rank, in_dim = g->in_dim, out = g->out_sizes[slice], bf16 = g->bf16;
    const int left = g->slot_lengths[slot] - first, m = left < LORA_TOKENS ? left : LORA_TOKENS;
    const int64_t a_sn = ((int64_t)slot * g->num_slices + slice) * rank * in_dim; /* element offsets */
    const int64_t b_sn = ((int64_t)slot * g->num_slices + slice) * g->max_out * rank;
    const int32_t *tokens = g->token_order + g->slot_starts[slot] + first;
    /* bf16 only: the group's x rows, one A row and 8 B rows widened to fp32 */
    float *scratch = bf16 ? malloc(sizeof(float) * ((size_t)(LORA_TOKENS + 1) * in_dim + 8 * (size_t)rank)) : NULL;
    if (bf16 && scratch == NULL) return 3;
    float *a_row = bf16 ? scratch + LORA_TOKENS * in_dim : NULL, *b_rows = bf16 ? a_row + in_dim : NULL;
    float h[LORA_TOKENS * rank], delta[8];
    const float *x_rows[LORA_TOKENS];
    int64_t y_at[LORA_TOKENS];
    for (int t = 0; t < m; t++) {
        x_rows[t] = as_f32(g->x, tokens[t] * g->x_row, in_dim, bf16, bf16 ? scratch + t * in_dim : NULL);
        y_at[t] = tokens[t] * g->y_row + g->offsets[slice];
    }
    for (int r = 0; r < rank; r++) { /* shrink: h[t] = x[t] @ A.T */
        if (r + LORA_PREFETCH_ROWS < rank)
            prefetch_bytes(g->a, a_sn + (int64_t)(r + LORA_PREFETCH_ROWS) * in_dim, in_dim, bf16);
        const float *a = as_f32(g->a, a_sn + (int64_t)r * in_dim, in_dim, bf16, a_row);
        for (int t = 0; t < m; t++) h[t * rank + r] = dot(x_rows[t], a, in_dim);
    }
    int o = 0; /* expand: y[t, o] += h[t] @ B[o] */
    for (; rank % 8 == 0 && o + 8 <= out; o += 8) {
        if (o + LORA_PREFETCH_OUTS + 8 <= out)
            prefetch_bytes(g->b, b_sn + (int64_t)(o + LORA_PREFETCH_OUTS) * rank, 8 * rank, bf16);
        const float *b = as_f32(g->b, b_sn + (int64_t)o * rank, 8 * rank, bf16, b_rows);
        for (int t = 0; t < m; t++) {
            v8sf acc[8];
            for (int j = 0; j < 8; j++) acc[j] = splat(0.0f);
            for (int r = 0; r < rank; r += 8) {
                const v8sf hv = load8(h + t * rank + r);
                for (int j = 0; j < 8; j++) acc[j] += hv * load8(b + j * rank + r);
            }
            store8(delta, sums8(acc));
            add_delta(g->y, y_at[t] + o, delta, 8, bf16);
        }
    }
    for (; o < out; o++) {
        const float *b = as_f32(g->b, b_sn + (int64_t)o * rank, rank, bf16, b_rows);
        for (int t = 0; t < m; t++) {
            delta[0] = dot(h + t * rank, b, rank);
            add_delta(g->y, y_at[t] + o, delta, 1, bf16);
        }
    }
    free(scratch);
    return 0;
}

/* The batched LoRA add above over num_slots slots and num_slices (<= 3) slices, fp32 or bf16 throughout. Returns
   0; 2 if the shapes are inconsistent, 3 if memory ran out. */
int pagedq_lora_add(void *y, int64_t y_row, const void *x, int64_t x_row, const void *lora_a, const void *lora_b,
                    int num_slots, int num_slices, int rank, int in_dim, int max_out, const int32_t *out_sizes,
                    const int32_t *token_order, const int32_t *slot_starts, const int32_t *slot_lengths, int bf16,
                    int num_threads) {
    if (num_slices < 1 || num_slices > 3 || rank < 1 || rank > LORA_MAX_RANK || in_dim < 1 || num_slots < 0 ||
        num_slots > LORA_MAX_SLOTS)
        return 2;
    LoraArgs g = {y, x, lora_a, lora_b, y_row, x_row, num_slices, rank, in_dim, max_out, bf16,
                  out_sizes, token_order, slot_starts, slot_lengths, {0}};
    for (int n = 0; n < num_slices; n++) {
        if (out_sizes[n] < 0 || out_sizes[n] > max_out) return 2;
        g.offsets[n + 1] = g.offsets[n] + out_sizes[n];
    }
    /* tasks: (slot, slice, group of LORA_TOKENS tokens), a slot's groups of one slice in a row, so the threads
       taking consecutive tasks share its weights in cache (prefill); slot s's tasks start at task_starts[s] */
    int64_t task_starts[num_slots + 1];
    task_starts[0] = 0;
    for (int s = 0; s < num_slots; s++) {
        if (slot_lengths[s] < 0) return 2;
        const int64_t groups = (slot_lengths[s] + LORA_TOKENS - 1) / LORA_TOKENS;
        task_starts[s + 1] = task_starts[s] + num_slices * groups;
    }
    int failed = 0;
#pragma omp parallel for schedule(dynamic) num_threads(num_threads)
    for (int64_t task = 0; task < task_starts[num_slots]; task++) {
        int slot = 0;
        while (task_starts[slot + 1] <= task) slot++;
        const int64_t groups = (task_starts[slot + 1] - task_starts[slot]) / num_slices, at = task - task_starts[slot];
        const int status = lora_task(&g, slot, (int)(at / groups), (int)(at % groups) * LORA_TOKENS);
        if (status) {
#pragma omp atomic write
            failed = status;
        }
    }
    return failed;
}
