
#ifdef CP_HICACHE_EMU
CP_HICACHE_EMU_EXPORT({{ uri }})
#endif
