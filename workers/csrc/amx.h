/* AMX tiles for the prompt kernel (paged_prefill.c), where the build targets them (-march=native on an
 * Intel Xeon with AMX-BF16). Linux lets a process use the tile state only once it asks (arch_prctl);
 * torch asks too before its own AMX kernels, so asking twice is harmless. Each kernel call loads its
 * tile shapes (as oneDNN does at each of its kernels) and releases the tiles when done.
 * The decode kernel does not use them: its bf16 scores on tiles (16 K rows read in place against a
 * kv head's query heads) were 22 % quicker cache-hot and no quicker in the engine, where it reads the
 * pool at memory's pace (bench/README.md, "Prompt attention on AMX tiles"). */
#ifndef MSERVE_AMX_H
#define MSERVE_AMX_H
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define MSERVE_AMX 1
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Whether the OS granted this process the tile state (asked once; a benign race between threads). */
static int amx_granted(void) {
    static int granted = -1;
    if (granted < 0) granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return granted;
}

/* Tiles 0..n-1 of rows[t] rows of colsb[t] bytes each. */
static inline void amx_configure(int n, const uint8_t *rows, const uint16_t *colsb) {
    struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < n; t++) { cfg.colsb[t] = colsb[t]; cfg.rows[t] = rows[t]; }
    _tile_loadconfig(&cfg);
}
#endif
#endif
