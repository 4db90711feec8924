/* Per-thread scratch memory that outlives a call: a kernel asks for at least `bytes` bytes and gets
 * the calling thread's buffer, grown (never shrunk) when a call needs more, so the kernels of a
 * decode step do not go to the allocator on every call (a large malloc is an mmap, and its first
 * touch page faults). Each source that includes this has its own buffer per thread. */
#ifndef PODIUM_SCRATCH_H
#define PODIUM_SCRATCH_H

#include <stdlib.h>

/* NAME(bytes): this thread's scratch of at least `bytes` bytes (NULL: no memory); its contents are
 * not kept. A source needing two buffers at once defines a second function. */
#define DEFINE_THREAD_SCRATCH(NAME)                                                                   \
    static inline void *NAME(size_t bytes) {                                                          \
        static __thread void *buffer;                                                                 \
        static __thread size_t capacity;                                                              \
        if (bytes > capacity) {                                                                       \
            void *grown = malloc(bytes);                                                              \
            if (!grown) return NULL;                                                                  \
            free(buffer);                                                                             \
            buffer = grown, capacity = bytes;                                                         \
        }                                                                                             \
        return buffer;                                                                                \
    }

DEFINE_THREAD_SCRATCH(thread_scratch)

#endif
