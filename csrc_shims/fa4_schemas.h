/* The schemas of the torch.ops.fa4 operators, in one place: libfa4_ops.so defines the operators
 * from them (a process that never runs Python, an AOTInductor model say, gets them by loading the
 * library), and where that library cannot load fa4 (Python) defines the same schemas through
 * libfa4_rules.so (fa4_schema), for the CPU path. */
#ifndef FA4_SCHEMAS_H
#define FA4_SCHEMAS_H
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Number of operators, and operator i's schema ("name(args) -> results", namespace fa4). */
int32_t fa4_schema_count(void);
const char *fa4_schema(int32_t index);

#ifdef __cplusplus
}
#endif
#endif
