/*
 * What the AMX kernels share: the process's permission to use the tile registers and the
 * tile configuration's layout (ldtilecfg's 64 bytes); with avx512.h's 2^t exponentials and
 * 16 x 16 transpose (packing B tiles in the VNNI layout).
 * Included by the kernels built for the `amx` level only.
 */
#ifndef TOKENSERVE_AMX_H
#define TOKENSERVE_AMX_H

#include <immintrin.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "avx512.h"

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux hands out AMX state only on request, once per process (torch/oneDNN usually asked
 * already); 1 if granted. */
static int amx_permitted(void) {
    static int state = 0; /* 0 unknown, 1 granted, -1 refused */
    if (state == 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
                                == 0 ? 1 : -1;
    return state == 1;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* ldtilecfg of a whole configuration. GCC 12's _tile_loadconfig tells the compiler that it
 * reads the configuration's first 8 bytes only, so the stores of the rows and column widths
 * may be dropped as dead (a configuration built in a small function of its own lost them,
 * and ldtilecfg faulted on whatever the stack held there): here the asm reads all 64 bytes. */
static inline __attribute__((always_inline)) void amx_load_config(const TileConfig *config) {
    __asm__ volatile("ldtilecfg %0" : : "m"(*config));
}

#endif
