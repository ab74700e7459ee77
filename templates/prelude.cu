// {{ uri }}
// Rendered by cp-hicache from templates/{{ template }}; do not edit: regenerate instead.
// Self-contained CUDA C: no headers; the integer names below are the only typedefs.
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef int i32;
typedef long long i64;
{% for c in consts %}
#define {{ c.name }} {{ c.value }}
{%- endfor %}
