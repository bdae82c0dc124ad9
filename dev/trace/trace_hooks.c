// dev/trace/trace_hooks.c: GCC's -finstrument-functions hooks for dev/trace/trace.sh. On the main thread
// (not OpenMP's workers, not the watchdog) they keep a stack of the functions entered, and between the
// second entry into the function at TRACE_FROM and the exit of the next one at TRACE_TO (addresses, hex:
// one training step after a warm-up) every distinct call edge, caller and callee, with how often it ran.
// At exit the edges go to TRACE_DIR/trace.RANK ("caller callee count" in hex and decimal, RANK from Open
// MPI's environment, else the pid); trace.py names them (nm on the -no-pie build).
// defines: __cyg_profile_func_enter, __cyg_profile_func_exit
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define LP_TRACE_DEPTH 4096
#define LP_TRACE_EDGES (1 << 16)  // a hash table of edges (a step has a few hundred)
static uintptr_t lp_trace_stack[LP_TRACE_DEPTH];
static int lp_trace_depth, lp_trace_started, lp_trace_on, lp_trace_from_seen;
static uintptr_t lp_trace_from, lp_trace_to;
static uintptr_t lp_trace_edge[LP_TRACE_EDGES][2];
static long lp_trace_count[LP_TRACE_EDGES];
static pthread_t lp_trace_main;  // the thread of the first call: main

__attribute__((no_instrument_function)) static void lp_trace_write(void) {
    const char *dir = getenv("TRACE_DIR"), *rank = getenv("OMPI_COMM_WORLD_RANK");
    char path[4096];
    if (rank) snprintf(path, sizeof(path), "%s/trace.%s", dir ? dir : ".", rank);
    else snprintf(path, sizeof(path), "%s/trace.%d", dir ? dir : ".", (int)getpid());
    FILE* f = fopen(path, "w");
    if (!f) return;
    for (int i = 0; i < LP_TRACE_EDGES; i++)
        if (lp_trace_count[i]) fprintf(f, "%lx %lx %ld\n", (unsigned long)lp_trace_edge[i][0], (unsigned long)lp_trace_edge[i][1], lp_trace_count[i]);
    fclose(f);
}

__attribute__((no_instrument_function)) static void lp_trace_start(void) {
    lp_trace_started = 1;
    lp_trace_main = pthread_self();
    const char *from = getenv("TRACE_FROM"), *to = getenv("TRACE_TO");
    lp_trace_from = from ? (uintptr_t)strtoull(from, NULL, 16) : 0;
    lp_trace_to = to ? (uintptr_t)strtoull(to, NULL, 16) : 0;
    atexit(lp_trace_write);
}

__attribute__((no_instrument_function)) void __cyg_profile_func_enter(void* fn, void* site) {
    (void)site;
    if (!lp_trace_started) lp_trace_start();
    if (!pthread_equal(pthread_self(), lp_trace_main)) return;
    uintptr_t f = (uintptr_t)fn;
    if (f == lp_trace_from && ++lp_trace_from_seen == 2) lp_trace_on = 1;
    if (lp_trace_on && lp_trace_depth > 0) {
        uintptr_t caller = lp_trace_stack[lp_trace_depth - 1];
        unsigned h = (unsigned)((caller * 31 + f) >> 4) & (LP_TRACE_EDGES - 1);
        while (lp_trace_count[h] && (lp_trace_edge[h][0] != caller || lp_trace_edge[h][1] != f)) h = (h + 1) & (LP_TRACE_EDGES - 1);
        lp_trace_edge[h][0] = caller;
        lp_trace_edge[h][1] = f;
        lp_trace_count[h]++;
    }
    if (lp_trace_depth < LP_TRACE_DEPTH) lp_trace_stack[lp_trace_depth] = f;
    lp_trace_depth++;
}

__attribute__((no_instrument_function)) void __cyg_profile_func_exit(void* fn, void* site) {
    (void)site;
    if (!pthread_equal(pthread_self(), lp_trace_main)) return;
    if (lp_trace_depth > 0) lp_trace_depth--;
    if (lp_trace_on && (uintptr_t)fn == lp_trace_to) lp_trace_on = 0;
}
