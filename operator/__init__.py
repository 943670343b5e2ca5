"""hybridkv.operator: the kopf operator for HybridModel resources."""
