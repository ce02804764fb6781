"""kha_compile inside other libraries' loading machinery: transformers' quantizer registry (:mod:`.hf_quantizer`)."""
