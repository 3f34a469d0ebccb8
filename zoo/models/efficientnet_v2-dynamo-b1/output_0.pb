
Boutput_0J(‡ÿp7k»‚vÅºsL;VDÕ»*èD¹ÙâŞ»Y €;Hçq»¼