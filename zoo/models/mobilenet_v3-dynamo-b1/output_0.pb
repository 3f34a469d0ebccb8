
Boutput_0J(bc>´Aq5€4è¬´h 5Ônh3¦rÝ³òØL4YÛ4K7ã²