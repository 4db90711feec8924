/* Replay of a captured decode step: the native kernel calls one forward made, in order, with the
 * arguments they had, from C (graphs.py records them while the step runs once under capture).
 *
 * A replay runs the same kernels over the same memory: the step's static inputs (token ids,
 * positions, slots, lengths, block tables), which the engine refills before each replay, every
 * intermediate tensor (kept alive by the capture) and the KV cache. What it saves is everything
 * between the kernels: the model's Python, the op dispatch, the argument checks and conversions,
 * the output allocations; on SmolLM2 at 32 decodes, ~140 us of each layer's ~1 ms.
 *
 * Each call names its kernel's signature (kind), so it is made through a correctly typed function
 * pointer: integer and pointer arguments in a[] in order, the one float argument (if any) in f.
 * The signatures are the kernels' own (native_kernels.SIGNATURES); graphs.py records only these.
 */
#include <stdint.h>

typedef struct {
    int64_t kind;
    void *fn;
    int64_t a[16];
    float f;
} Call;

enum { FUSED_LINEAR, LINEAR, ATTENTION, NORM, EMBED, SILU, ROTARY, WRITE_KV };

typedef const void *P;
typedef int (*fused_linear_fn)(P, int64_t, P, int64_t, P, float, P, int, int64_t, P, int64_t, int64_t, P, P, int64_t,
                               int);
typedef int (*linear_fn)(P, int64_t, int64_t, P, int64_t, int64_t, P, P, int64_t, int);
typedef int (*attention_fn)(P, P, P, P, P, P, P, P, int);
typedef int (*norm_fn)(P, int64_t, P, int64_t, P, P, P, int64_t, int64_t, float, int);
typedef int (*embed_fn)(P, int64_t, int64_t, P, int64_t, P, int);
typedef int (*silu_fn)(P, int64_t, P, int64_t, int64_t, int);
typedef int (*rotary_fn)(P, int64_t, P, int64_t, P, P, P, P, int64_t, int64_t, int64_t, int64_t, int64_t, int);
typedef int (*write_kv_fn)(P, int64_t, P, int64_t, P, P, P, int64_t, int64_t, int64_t, int64_t);

#define A(i) (c->a[i])
#define PA(i) ((P)(intptr_t)c->a[i])

static int call(const Call *c) {
    switch (c->kind) {
        case FUSED_LINEAR:
            return ((fused_linear_fn)c->fn)(PA(0), A(1), PA(2), A(3), PA(4), c->f, PA(5), (int)A(6), A(7), PA(8), A(9),
                                            A(10), PA(11), PA(12), A(13), (int)A(14));
        case LINEAR:
            return ((linear_fn)c->fn)(PA(0), A(1), A(2), PA(3), A(4), A(5), PA(6), PA(7), A(8), (int)A(9));
        case ATTENTION:
            return ((attention_fn)c->fn)(PA(0), PA(1), PA(2), PA(3), PA(4), PA(5), PA(6), PA(7), (int)A(8));
        case NORM:
            return ((norm_fn)c->fn)(PA(0), A(1), PA(2), A(3), PA(4), PA(5), PA(6), A(7), A(8), c->f, (int)A(9));
        case EMBED:
            return ((embed_fn)c->fn)(PA(0), A(1), A(2), PA(3), A(4), PA(5), (int)A(6));
        case SILU:
            return ((silu_fn)c->fn)(PA(0), A(1), PA(2), A(3), A(4), (int)A(5));
        case ROTARY:
            return ((rotary_fn)c->fn)(PA(0), A(1), PA(2), A(3), PA(4), PA(5), PA(6), PA(7), A(8), A(9), A(10), A(11),
                                      A(12), (int)A(13));
        case WRITE_KV:
            return ((write_kv_fn)c->fn)(PA(0), A(1), PA(2), A(3), PA(4), PA(5), PA(6), A(7), A(8), A(9), A(10));
        default:
            return -2;
    }
}

/* Make calls[0..n) in order; 0, or 1 + the index of the first call that failed (its kernel returned
 * nonzero: it could not allocate scratch memory, or an unknown kind) */
int podium_replay(const Call *calls, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (call(calls + i) != 0) return (int)(i + 1);
    return 0;
}
