/* kvtier's copy executor: one native thread that makes a CUDA copy backend's enqueue calls;
 * and the staged strategy's planner, which writes such calls for a whole transfer at once.
 *
 * Why native: a Python thread making these calls needs the GIL between every two of them, and a
 * busy engine thread hands the GIL over only every switch interval (5 ms): each hand-over stalls
 * the engine's thread for one or two thread wake-ups (0.1-0.6 ms measured on an H100 host), and
 * the issuing thread gets one CUDA call per interval. This thread never touches Python.
 *
 * Python records a transfer's calls as a program (``uint64`` rows of KVX_WORDS words: the op
 * code, then its arguments), pushes it, and keeps every buffer the program points at alive until
 * the program ran. Programs run one after another, in push order, each op in order. When an op
 * fails the rest of its program is skipped, every stream the program used so far is
 * synchronized (nothing it enqueued still runs when Python frees its resources), and the status
 * says which op failed and why. The status words are written before ``executed`` moves past the
 * program (under the mutex), so a reader that saw ``executed`` sees them.
 *
 * CUDA entry points come in as addresses (from the libraries the process already loaded), so
 * this file needs no CUDA headers and the CPU tests can pass callbacks instead.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define KVX_WORDS 8

enum { OP_WAIT = 1, OP_RECORD = 2, OP_MEMCPY = 3, OP_BATCH = 4, OP_LAUNCH = 5, OP_SYNC = 6 };
enum { FN_SET_DEVICE, FN_WAIT, FN_RECORD, FN_MEMCPY, FN_BATCH, FN_LAUNCH, FN_SYNC, FN_COUNT };
enum { STATE_QUEUED = 0, STATE_DONE = 1, STATE_FAILED = 2 };
/* status words */
enum { ST_STATE, ST_ERROR, ST_OP, ST_NANOS, ST_WORDS };

typedef int (*set_device_fn)(int);
typedef int (*wait_fn)(void *, void *, unsigned);
typedef int (*record_fn)(void *, void *);
typedef int (*memcpy_fn)(void *, const void *, size_t, int, void *);
typedef int (*batch_fn)(void *, void *, void *, size_t, void *, void *, size_t, void *);
typedef int (*batch_fail_idx_fn)(void *, void *, void *, size_t, void *, void *, size_t, size_t *,
                                 void *);
typedef int (*launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                         unsigned, void *, void **, void **);
typedef int (*sync_fn)(void *);

typedef struct {
    const uint64_t *ops;
    int64_t n;
    int64_t *status;
} Program;

typedef struct {
    void *fn[FN_COUNT];
    int batch_has_fail_idx;
    int device;
    pthread_mutex_t mu;
    pthread_cond_t work;
    pthread_cond_t done;
    Program *queue;
    int64_t cap, head, count;
    int64_t pushed, executed;
    int closing;
    pthread_t thread;
} Executor;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* The stream an op enqueues on (0: none). */
static void *op_stream(const uint64_t *op) {
    switch (op[0]) {
    case OP_WAIT: return (void *)op[1];
    case OP_RECORD: return (void *)op[2];
    case OP_MEMCPY: return (void *)op[4];
    case OP_BATCH: return (void *)op[7];
    case OP_LAUNCH: return (void *)op[5];
    case OP_SYNC: return (void *)op[1];
    default: return 0;
    }
}

static int run_op(Executor *ex, const uint64_t *op) {
    switch (op[0]) {
    case OP_WAIT:
        return ((wait_fn)ex->fn[FN_WAIT])((void *)op[1], (void *)op[2], 0);
    case OP_RECORD:
        return ((record_fn)ex->fn[FN_RECORD])((void *)op[1], (void *)op[2]);
    case OP_MEMCPY: /* 4: cudaMemcpyDefault */
        return ((memcpy_fn)ex->fn[FN_MEMCPY])((void *)op[1], (const void *)op[2], (size_t)op[3],
                                              4, (void *)op[4]);
    case OP_BATCH:
        if (ex->batch_has_fail_idx) {
            size_t fail_idx = 0;
            return ((batch_fail_idx_fn)ex->fn[FN_BATCH])(
                (void *)op[1], (void *)op[2], (void *)op[3], (size_t)op[4], (void *)op[5],
                (void *)op[6], 1, &fail_idx, (void *)op[7]);
        }
        return ((batch_fn)ex->fn[FN_BATCH])((void *)op[1], (void *)op[2], (void *)op[3],
                                            (size_t)op[4], (void *)op[5], (void *)op[6], 1,
                                            (void *)op[7]);
    case OP_LAUNCH:
        return ((launch_fn)ex->fn[FN_LAUNCH])((void *)op[1], (unsigned)op[2], 1, 1,
                                              (unsigned)op[3], 1, 1, 0, (void *)op[5],
                                              (void **)op[4], 0);
    case OP_SYNC:
        return ((sync_fn)ex->fn[FN_SYNC])((void *)op[1]);
    default:
        return -1;
    }
}

static void run_program(Executor *ex, const Program *p) {
    int64_t start = now_ns();
    int64_t state = STATE_DONE;
    for (int64_t i = 0; i < p->n; ++i) {
        const uint64_t *op = p->ops + i * KVX_WORDS;
        int rc = run_op(ex, op);
        if (rc == 0) continue;
        p->status[ST_ERROR] = rc;
        p->status[ST_OP] = i;
        state = STATE_FAILED;
        /* Drain what this program enqueued (a stream twice is harmless: the second returns at
         * once). A failing synchronize means a broken context: nothing runs any more anyway. */
        for (int64_t j = 0; j < i; ++j) {
            void *stream = op_stream(p->ops + j * KVX_WORDS);
            if (stream) ((sync_fn)ex->fn[FN_SYNC])(stream);
        }
        break;
    }
    p->status[ST_NANOS] = now_ns() - start;
    __atomic_store_n(&p->status[ST_STATE], state, __ATOMIC_RELEASE); /* last: readers poll it */
}

static void *thread_main(void *arg) {
    Executor *ex = (Executor *)arg;
    if (ex->fn[FN_SET_DEVICE]) ((set_device_fn)ex->fn[FN_SET_DEVICE])(ex->device);
    pthread_mutex_lock(&ex->mu);
    for (;;) {
        while (ex->count == 0 && !ex->closing) pthread_cond_wait(&ex->work, &ex->mu);
        if (ex->count == 0) break; /* closing, and everything pushed has run */
        Program p = ex->queue[ex->head];
        ex->head = (ex->head + 1) % ex->cap;
        ex->count -= 1;
        pthread_mutex_unlock(&ex->mu);
        run_program(ex, &p);
        pthread_mutex_lock(&ex->mu);
        ex->executed += 1;
        pthread_cond_broadcast(&ex->done);
    }
    pthread_mutex_unlock(&ex->mu);
    return 0;
}

/* fns: FN_COUNT addresses in FN_* order (FN_SET_DEVICE may be 0). NULL when the thread could not
 * start. */
void *kvx_create(const uint64_t *fns, int batch_has_fail_idx, int device) {
    Executor *ex = (Executor *)calloc(1, sizeof(Executor));
    if (!ex) return 0;
    for (int i = 0; i < FN_COUNT; ++i) ex->fn[i] = (void *)fns[i];
    ex->batch_has_fail_idx = batch_has_fail_idx;
    ex->device = device;
    ex->cap = 64;
    ex->queue = (Program *)calloc((size_t)ex->cap, sizeof(Program));
    pthread_mutex_init(&ex->mu, 0);
    pthread_cond_init(&ex->work, 0);
    pthread_cond_init(&ex->done, 0);
    if (!ex->queue || pthread_create(&ex->thread, 0, thread_main, ex) != 0) {
        free(ex->queue);
        free(ex);
        return 0;
    }
    return ex;
}

/* Queue a program; returns its sequence number (1, 2, ...), or -1 when closing or out of memory. */
int64_t kvx_push(void *handle, const uint64_t *ops, int64_t n, int64_t *status) {
    Executor *ex = (Executor *)handle;
    pthread_mutex_lock(&ex->mu);
    if (ex->closing) {
        pthread_mutex_unlock(&ex->mu);
        return -1;
    }
    if (ex->count == ex->cap) {
        Program *grown = (Program *)calloc((size_t)ex->cap * 2, sizeof(Program));
        if (!grown) {
            pthread_mutex_unlock(&ex->mu);
            return -1;
        }
        for (int64_t i = 0; i < ex->count; ++i) grown[i] = ex->queue[(ex->head + i) % ex->cap];
        free(ex->queue);
        ex->queue = grown;
        ex->head = 0;
        ex->cap *= 2;
    }
    Program *slot = &ex->queue[(ex->head + ex->count) % ex->cap];
    slot->ops = ops;
    slot->n = n;
    slot->status = status;
    ex->count += 1;
    ex->pushed += 1;
    int64_t seq = ex->pushed;
    pthread_cond_signal(&ex->work);
    pthread_mutex_unlock(&ex->mu);
    return seq;
}

/* How many programs have run to the end (or failed). */
int64_t kvx_executed(void *handle) {
    Executor *ex = (Executor *)handle;
    pthread_mutex_lock(&ex->mu);
    int64_t executed = ex->executed;
    pthread_mutex_unlock(&ex->mu);
    return executed;
}

/* Wait until program ``seq`` ran, at most ``timeout_ms``; 1 if it did. */
int kvx_wait(void *handle, int64_t seq, int64_t timeout_ms) {
    Executor *ex = (Executor *)handle;
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += timeout_ms / 1000;
    deadline.tv_nsec += (timeout_ms % 1000) * 1000000L;
    if (deadline.tv_nsec >= 1000000000L) {
        deadline.tv_sec += 1;
        deadline.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&ex->mu);
    while (ex->executed < seq) {
        if (pthread_cond_timedwait(&ex->done, &ex->mu, &deadline) != 0) break;
    }
    int reached = ex->executed >= seq;
    pthread_mutex_unlock(&ex->mu);
    return reached;
}

/* Run what is queued, stop the thread, free everything. */
void kvx_close(void *handle) {
    Executor *ex = (Executor *)handle;
    pthread_mutex_lock(&ex->mu);
    ex->closing = 1;
    pthread_cond_signal(&ex->work);
    pthread_mutex_unlock(&ex->mu);
    pthread_join(ex->thread, 0);
    pthread_mutex_destroy(&ex->mu);
    pthread_cond_destroy(&ex->work);
    pthread_cond_destroy(&ex->done);
    free(ex->queue);
    free(ex);
}

/* -- staged plans ------------------------------------------------------------------------------
 *
 * The ops of a staged transfer's chunks (see staged.py for the pipeline), with each chunk's
 * kernel parameters and copy list, written in one pass: in Python the same took 40 numpy calls
 * and most of a staged submit. Pure arithmetic: no CUDA call, no allocation. */

typedef struct {
    /* the transfer */
    int64_t n_blocks;
    const int64_t *blocks;     /* engine block ids */
    const uint64_t *hosts;     /* each block's address in the pool */
    int64_t to_host;
    int64_t block_bytes;
    int64_t n_chunks;
    const int64_t *chunk_blocks; /* blocks per chunk */
    /* streams and events */
    uint64_t main_stream;
    int64_t n_lanes;
    const uint64_t *lanes;
    const uint64_t *events;     /* per chunk a hand-over event, then per chunk a free event */
    /* the staging ring */
    uint64_t ring_base;
    int64_t buffer_bytes;
    int64_t n_buffers;
    int64_t first_buffer;
    const uint64_t *buffer_free; /* per buffer: the event marking it free (0: never used) */
    /* the kernel */
    uint64_t kernel;
    int64_t threads;
    int64_t warps;
    int64_t max_sms;
    int64_t capacity;
    int64_t param_bytes;
    uint64_t region_table;
    int64_t piece_bytes;
    int64_t n_regions;
    /* batched copies */
    uint64_t attrs;
    uint64_t attr_index;
    /* out: n_chunks * 6 ops, n_chunks parameter rows (zeroed), n_chunks kernelParams slots,
     * n_blocks entries per copy list */
    uint64_t *ops;
    uint8_t *params;
    uint64_t *kernel_params;
    uint64_t *copy_dsts;
    uint64_t *copy_srcs;
    uint64_t *copy_sizes;
    /* the pool's pinned pieces: no copy runs across the start of one (pin_step 0: one piece) */
    uint64_t pin_base;
    uint64_t pin_step;
} StagedPlan;

static uint64_t *put_op(uint64_t *op, uint64_t code, uint64_t a, uint64_t b, uint64_t c,
                        uint64_t d, uint64_t e, uint64_t f, uint64_t g) {
    op[0] = code; op[1] = a; op[2] = b; op[3] = c; op[4] = d; op[5] = e; op[6] = f; op[7] = g;
    return op + KVX_WORDS;
}

/* Returns the number of ops written. */
int64_t kvx_plan_staged(const StagedPlan *p) {
    uint64_t *op = p->ops;
    int64_t block = 0, run = 0;
    for (int64_t k = 0; k < p->n_chunks; ++k) {
        const int64_t count = p->chunk_blocks[k];
        const int64_t buffer = (p->first_buffer + k) % p->n_buffers;
        const uint64_t stage = p->ring_base + (uint64_t)(buffer * p->buffer_bytes);
        const uint64_t lane = p->lanes[k % p->n_lanes];
        const uint64_t hand = p->events[k], freed = p->events[p->n_chunks + k];
        const uint64_t wait = k >= p->n_buffers ? p->events[p->n_chunks + k - p->n_buffers]
                                                : p->buffer_free[buffer];
        /* Params<capacity>: see kernels.py and plan.pack_params. */
        uint8_t *row = p->params + k * p->param_bytes;
        int32_t header[4] = {0, (int32_t)p->n_regions, (int32_t)count, (int32_t)p->to_host};
        memcpy(row, &p->region_table, 8);
        memcpy(row + 8, &p->piece_bytes, 8);
        memcpy(row + 16, header, 16);
        uint64_t *host_addr = (uint64_t *)(row + 32);
        int32_t *block_id = (int32_t *)(row + 32 + 8 * p->capacity);
        p->kernel_params[k] = (uint64_t)(uintptr_t)row;
        /* The copy list: slots next to each other in the pool join into one copy (the staging
         * side of a chunk is contiguous). */
        const int64_t first_run = run;
        for (int64_t i = 0; i < count; ++i) {
            const uint64_t staged = stage + (uint64_t)(i * p->block_bytes);
            const uint64_t host = p->hosts[block + i];
            host_addr[i] = staged;
            block_id[i] = (int32_t)p->blocks[block + i];
            const uint64_t dst = p->to_host ? host : staged, src = p->to_host ? staged : host;
            const int piece_starts = p->pin_step && (host - p->pin_base) % p->pin_step == 0;
            if (run > first_run && !piece_starts &&
                p->copy_dsts[run - 1] + p->copy_sizes[run - 1] == dst &&
                p->copy_srcs[run - 1] + p->copy_sizes[run - 1] == src) {
                p->copy_sizes[run - 1] += (uint64_t)p->block_bytes;
            } else {
                p->copy_dsts[run] = dst;
                p->copy_srcs[run] = src;
                p->copy_sizes[run] = (uint64_t)p->block_bytes;
                run += 1;
            }
        }
        block += count;
        int64_t grid = (count * p->n_regions + p->warps - 1) / p->warps;
        if (grid > p->max_sms) grid = p->max_sms;
        if (grid < 1) grid = 1;
        const uint64_t first_stream = p->to_host ? p->main_stream : lane;
        const uint64_t second_stream = p->to_host ? lane : p->main_stream;
        uint64_t copy[KVX_WORDS], launch[KVX_WORDS];
        const int64_t runs = run - first_run;
        if (runs == 1) {
            put_op(copy, OP_MEMCPY, p->copy_dsts[first_run], p->copy_srcs[first_run],
                   p->copy_sizes[first_run], lane, 0, 0, 0);
        } else {
            put_op(copy, OP_BATCH, (uint64_t)(uintptr_t)(p->copy_dsts + first_run),
                   (uint64_t)(uintptr_t)(p->copy_srcs + first_run),
                   (uint64_t)(uintptr_t)(p->copy_sizes + first_run), (uint64_t)runs, p->attrs,
                   p->attr_index, lane);
        }
        put_op(launch, OP_LAUNCH, p->kernel, (uint64_t)grid, (uint64_t)p->threads,
               (uint64_t)(uintptr_t)(p->kernel_params + k), p->main_stream, 0, 0);
        if (wait) op = put_op(op, OP_WAIT, first_stream, wait, 0, 0, 0, 0, 0);
        memcpy(op, p->to_host ? launch : copy, sizeof copy);
        op += KVX_WORDS;
        op = put_op(op, OP_RECORD, hand, first_stream, 0, 0, 0, 0, 0);
        op = put_op(op, OP_WAIT, second_stream, hand, 0, 0, 0, 0, 0);
        memcpy(op, p->to_host ? copy : launch, sizeof copy);
        op += KVX_WORDS;
        op = put_op(op, OP_RECORD, freed, second_stream, 0, 0, 0, 0, 0);
    }
    return (op - p->ops) / KVX_WORDS;
}
